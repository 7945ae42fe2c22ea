"""Models (`MODELS`), data and the training steps the benchmarks time: jdist's (`jdist_step`,
`jit_step`), hand-written ones (`pmap_step`, `shard_map_step`, `mpi4jax_step`) and floors.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jdist
from benchmarks.harness import timing
from jdist.app import models

IMAGE_SHAPE = (28, 28, 1)
NUM_CLASSES = 10


# name -> hidden widths of an MLP on 784 inputs, or None for the CNN.
MODELS: dict[str, tuple[int, ...] | None] = {
    "cnn": None,
    "mlp1m": (1024, 256),      # 1.07M parameters
    "mlp10m": (4096, 1664),    # 10.1M parameters
    "mlp-tiny": (64,),         # smoke runs
    "mlp-small": (256, 128),   # smoke runs, 0.24M parameters
}


def build(name: str) -> nn.Module:
  """The flax module registered under `name` in `MODELS`."""
  if name not in MODELS:
    raise ValueError(f"Unknown benchmark model {name!r}; choose from {sorted(MODELS)}.")
  widths = MODELS[name]
  if widths is None:
    return models.CNN(num_classes=NUM_CLASSES)  # SINGA's, 431,080 parameters on 28x28x1
  return models.MLP(features=widths, num_classes=NUM_CLASSES)


def init_params(model: nn.Module, seed: int = 0) -> Any:
  dummy = jnp.zeros((1,) + IMAGE_SHAPE, jnp.float32)
  return jax.jit(model.init)(jax.random.key(seed), dummy)["params"]


def local_batch(devices: int, per_replica: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Random images and labels shaped [devices, per_replica, ...] (host arrays)."""
  rng = np.random.default_rng(seed)
  x = rng.random((devices, per_replica) + IMAGE_SHAPE, dtype=np.float32)
  y = rng.integers(0, NUM_CLASSES, size=(devices, per_replica)).astype(np.int32)
  return x, y


def loss_and_grads(model: nn.Module, params, x, y):
  def loss_fn(p):
    return models.cross_entropy_loss(model.apply({"params": p}, x), y)
  loss, grads = jax.value_and_grad(loss_fn)(params)
  return loss, grads


def _user_step(model: nn.Module, tx: optax.GradientTransformation, *, mean_loss: bool = True):
  """The step a user writes once for either style."""

  def step(params, opt_state, x, y):
    loss, grads = loss_and_grads(model, params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            jdist.pmean(loss) if mean_loss else loss)

  return step


def jdist_step(model: nn.Module, tx: optax.GradientTransformation, *,
               check_inputs: bool = True):
  """A user's jdist train step: `(params, opt_state, x, y) -> (params, opt_state, loss)`."""
  return jdist.data_parallel(check_inputs=check_inputs)(_user_step(model, tx))


def jit_step(model: nn.Module, tx: optax.GradientTransformation):
  """A user's jit step over global arrays (the README's quickstart), under `jdist.mesh()`."""
  return jax.jit(_user_step(model, tx))


def pmap_step(model: nn.Module, tx: optax.GradientTransformation):
  """The hand-written pmap step: gradients averaged with `lax.pmean`, then `tx`."""

  def step(params, opt_state, x, y):
    loss, grads = loss_and_grads(model, params, x, y)
    grads = jax.lax.pmean(grads, axis_name="i")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axis_name="i")

  return jax.pmap(step, axis_name="i")


def shard_map_step(model: nn.Module, tx: optax.GradientTransformation):
  """The hand-written `jit(shard_map)` step over the local devices, pmap's calling convention."""
  mesh = Mesh(np.array(jax.local_devices()), ("i",))
  spec = PartitionSpec("i")

  def per_device(params, opt_state, x, y):
    params, opt_state, x, y = jax.tree.map(lambda a: a[0], (params, opt_state, x, y))
    loss, grads = loss_and_grads(model, params, x, y)
    grads = jax.lax.pmean(grads, axis_name="i")
    updates, opt_state = tx.update(grads, opt_state, params)
    out = optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, axis_name="i")
    return jax.tree.map(lambda a: jnp.asarray(a)[None], out)

  return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec,
                               check_vma=False))


def mpi4jax_sum(comm):
  """`flat -> its sum over `comm`'s ranks`, one `mpi4jax.allreduce` (traceable)."""
  import mpi4jax  # pylint: disable=import-outside-toplevel
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel

  def total(flat):
    out = mpi4jax.allreduce(flat, op=MPI.SUM, comm=comm)
    return out[0] if isinstance(out, tuple) else out  # older mpi4jax: (out, token)

  return total


def mpi4jax_step(model: nn.Module, tx: optax.GradientTransformation, comm):
  """The hand-written step body (uncompiled), one device per process: the raveled gradients
  summed by one `mpi4jax.allreduce` over `comm`, averaged, then `tx`; this process's loss.
  """
  total, size = mpi4jax_sum(comm), comm.Get_size()

  def step(params, opt_state, x, y):
    loss, grads = loss_and_grads(model, params, x, y)
    flat, unravel = ravel_pytree(grads)
    updates, opt_state = tx.update(unravel(total(flat) / size), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def compute_step(model: nn.Module, tx: optax.GradientTransformation):
  """The step with no reduction of its own (the compute floor)."""
  return jdist.data_parallel(_user_step(model, tx, mean_loss=False))


def plain_jit_step(model: nn.Module, tx: optax.GradientTransformation):
  """The step under a bare `jax.jit` (plain JAX multi-controller)."""
  return jax.jit(_user_step(model, tx, mean_loss=False))


@dataclasses.dataclass
class Setup:
  """A model with replicated parameters and this process's batch."""
  name: str
  model: nn.Module
  params: Any  # replicated: leading local-device axis
  batch: tuple[Any, Any]  # on device, [local_devices, per_replica, ...]
  param_count: int

  def opt_state(self, tx: optax.GradientTransformation, *, init=None) -> Any:
    """`tx`'s replicated initial state (built with `init`, default data_parallel)."""
    return (init or jdist.data_parallel)(tx.init)(self.params)

  def stepper(self, step, tx: optax.GradientTransformation, *, init=None) -> timing.Stepper:
    """A fresh stepper of `style` on this batch."""
    return timing.Stepper(step, (self.params, self.opt_state(tx, init=init)), self.batch)


def setup(name: str, per_replica: int, seed: int = 0) -> Setup:
  """Builds model `name`, the same parameters on every rank, and a batch per rank."""
  topo = jdist.init()  # the job's topology (init is idempotent)
  model = build(name)
  params = init_params(model, seed)
  x, y = local_batch(topo.local_device_count, per_replica, seed + 1 + topo.process_index)
  return Setup(name, model, jdist.replicate(params), (shard(x), shard(y)),
               models.param_count(params))


STYLES = ("data_parallel", "jit")


@dataclasses.dataclass
class StyleSetup:
  """One global batch and a model's parameters placed for both step styles (`dp_*`, `jit_*`)."""
  model: nn.Module
  process_rows: tuple[np.ndarray, np.ndarray]
  dp_params: Any
  dp_batch: tuple[Any, Any]
  jit_params: Any
  jit_batch: tuple[Any, Any]

  def stepper(self, style: str, tx: optax.GradientTransformation,
              step=None) -> timing.Stepper:
    """A fresh stepper of `style` from these parameters and `tx`'s initial state on this batch
    (`step` defaults to the user's step of that style).
    """
    if style == "jit":
      replicated = NamedSharding(jdist.mesh(), PartitionSpec())
      state = jax.jit(tx.init, out_shardings=replicated)(self.jit_params)
      return timing.Stepper(step or jit_step(self.model, tx), (self.jit_params, state),
                            self.jit_batch)
    state = jdist.data_parallel(tx.init)(self.dp_params)
    return timing.Stepper(step or jdist_step(self.model, tx), (self.dp_params, state),
                          self.dp_batch)


def style_setup(model: nn.Module, params: Any, x: np.ndarray, y: np.ndarray) -> StyleSetup:
  """`params` and the global batch `(x, y)` placed for both styles (under `jdist.mesh()`)."""
  devices = jdist.init().local_device_count
  rows_x, rows_y = jdist.process_slice((x, y))
  dp_batch = (shard(rows_x.reshape((devices, -1) + x.shape[1:])),
              shard(rows_y.reshape(devices, -1)))
  jit_params = jax.device_put(params, NamedSharding(jdist.mesh(), PartitionSpec()))
  return StyleSetup(model, (rows_x, rows_y), jdist.replicate(params), dp_batch, jit_params,
                    jdist.shard_global_batch((x, y)))


@functools.cache
def local_sharding() -> NamedSharding:
  """Axis 0 split over this process's devices (built once: a step's inputs use it)."""
  return NamedSharding(Mesh(np.array(jax.local_devices()), ("devices",)),
                       PartitionSpec("devices"))


def shard(array: np.ndarray) -> jax.Array:
  """A host array [local_devices, ...] split over the local devices along axis 0."""
  return jax.device_put(array, local_sharding())
