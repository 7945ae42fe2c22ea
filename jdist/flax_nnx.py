"""Flax NNX in both step styles: the data_parallel adapter and a synchronized BatchNorm.

With `nnx.Optimizer(model, jdist.dist_opt(...), wrt=nnx.Param)` an NNX model
trains data-parallel as it is in a jit step over global arrays
(`examples/nnx_mnist.py`). `nnx_data_parallel` is `nnx.jit` for the
per-replica style (`examples/nnx_mnist_data_parallel.py`): the step takes and
updates NNX objects, which hold the replicated layout (one copy per local
device) from its first call on; `replica_mean` averages their per-replica
host values (metrics) over the job.

What still depends on the replicas is batch normalization: `nnx.BatchNorm`
normalizes with the moments of the batch it sees (one replica's, or one
process's in a jit step), so replicas drift apart in their running
statistics. `SyncBatchNorm` takes the moments over every replica of the job
instead, as one device would on the whole global batch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jdist import parallel
from jdist.collectives import context
from jdist.collectives import ops
from jdist.runtime import host


def _in_replicated_layout(leaf, devices: int) -> bool:
  sharding = getattr(leaf, "sharding", None)
  return (isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.spec) > 0
          and sharding.spec[0] == context.DATA_AXIS and leaf.shape[:1] == (devices,))


def _replicated(state: Any) -> Any:
  """The state in the replicated layout: leaves not yet in it get a copy per local device."""
  devices = jax.local_device_count()
  return jax.tree.map(lambda leaf: leaf if _in_replicated_layout(leaf, devices)
                      else parallel.replicate(leaf), state)


def _marked(state: Any) -> Any:
  """The state's arrays annotated with the replicated layout's sharding.

  On one device XLA may return a (1, ...) output as replicated; the
  annotation (no copy) lets the next call see it is laid out already.
  """
  sharding = context.per_device_sharding(jax.local_devices())
  return jax.tree.map(lambda leaf: jax.device_put(leaf, sharding), state)


def nnx_data_parallel(fn: Callable | None = None, *, out_axes: Any = 0) -> Callable:
  """`jdist.data_parallel` for Flax NNX: a per-replica step over NNX objects, like `nnx.jit`.

  Positional arguments that are NNX objects (`nnx.Module`, `nnx.Optimizer`,
  `nnx.MultiMetric`, any `nnx.Pytree`) are passed to `fn` as objects, and
  what `fn` does to them (an optimizer update, new batch statistics, metric
  updates) is written back into them, as `nnx.jit` does. Every other
  argument is mapped over the local devices, as `jdist.data_parallel`'s
  in_axes=0 (a batch from `jdist.shard(jdist.process_slice(...))`).

  The objects hold the replicated layout: on the first call their state gets
  a copy per local device (`jdist.replicate`; build them equal on every
  process: the same seed, or `jdist.broadcast_params` of `nnx.state`), and
  each replica keeps its own copy from then on (error-feedback residuals of
  `jdist.topk` differ per replica). Their state, `nnx.state(model)`, is then
  what `jdist.CheckpointManager` saves in the replicated style; host values
  computed from it (`metrics.compute()`) carry the device axis:
  `jdist.replica_mean` averages them over the job.

  Example:
    ```python
    optimizer = nnx.Optimizer(model, jdist.dist_opt(optax.adamw(1e-3)), wrt=nnx.Param)

    @jdist.nnx_data_parallel(out_axes=None)   # the pmean'd loss without the device axis
    def train_step(model, optimizer, batch):
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      optimizer.update(model, grads)
      return jdist.pmean(loss)

    loss = train_step(model, optimizer, jdist.shard(jdist.process_slice(batch)))
    ```

  Args:
    fn: the per-replica step. Usable as `@nnx_data_parallel` or
      `@nnx_data_parallel(out_axes=None)`.
    out_axes: for `fn`'s return value, as in `jdist.data_parallel`: 0 (per
      device), None (the same on every device, such as a `jdist.pmean`'d
      loss) or a tuple of 0/None per element of a tuple output. NNX objects
      cannot be returned; they are updated in place.

  Returns:
    The step: called with the objects and the mapped arrays, it returns
    `fn`'s output. Each new structure of objects compiles once.
  """
  if fn is None:
    return functools.partial(nnx_data_parallel, out_axes=out_axes)
  axes = (0,) + out_axes if isinstance(out_axes, tuple) else (0, out_axes)
  compiled = {}

  def build(graphdef, at: tuple, count: int):
    def per_replica(state, *others):
      nodes = nnx.merge(graphdef, state)
      rest = iter(others)
      objects = dict(zip(at, nodes))
      out = fn(*[objects[i] if i in objects else next(rest) for i in range(count)])
      new_state = nnx.state(nodes)
      return (new_state,) + out if isinstance(out_axes, tuple) else (new_state, out)
    per_replica.__name__ = getattr(fn, "__name__", "step")
    return parallel.data_parallel(per_replica, out_axes=axes)

  @functools.wraps(fn)
  def step(*args):
    at = tuple(i for i, arg in enumerate(args) if isinstance(arg, nnx.Pytree))
    nodes = tuple(args[i] for i in at)
    graphdef, state = nnx.split(nodes)
    key = (graphdef, at, len(args))
    if key not in compiled:
      compiled[key] = build(graphdef, at, len(args))
    out = compiled[key](_replicated(state), *[a for i, a in enumerate(args) if i not in at])
    nnx.update(nodes, _marked(out[0]))
    return out[1:] if isinstance(out_axes, tuple) else out[1]

  return step


def replica_mean(tree: Any) -> Any:
  """The mean over every replica of the job of per-replica host values.

  For values with a leading local-device axis, such as `metrics.compute()`
  of metrics updated in an `nnx_data_parallel` step: the mean over this
  process's devices, then over the processes (`jdist.host_allreduce`). With
  equal batches per replica, the mean of the replicas' averages and
  accuracies is the job's.
  """
  local = jax.tree.map(lambda x: np.mean(np.asarray(x), axis=0), tree)
  return host.host_allreduce(local, mean=True)


class SyncBatchNorm(nnx.Module):
  """BatchNorm over the feature axis whose batch moments span every replica.

  A drop-in for `nnx.BatchNorm(num_features, ...)` with its defaults
  (momentum 0.99, epsilon 1e-5, scale and bias, variance as E[x^2] -
  E[x]^2). In training mode the per-replica means of x and x^2 are averaged
  with `jdist.pmean` (replicas hold equal batches), so every replica
  normalizes with the global batch's moments and keeps identical running
  statistics. `model.train()` / `model.eval()` switch it like BatchNorm.
  Training differentiates through that `jdist.pmean` (in every topology and
  both step styles): the replicas' gradients, averaged as `jdist.dist_opt`
  does, are one device's gradients on the whole batch.

  Args:
    num_features: size of the last axis.
    use_running_average: normalize with the running statistics (evaluation).
    momentum: decay of the running statistics.
    epsilon: added to the variance.
    rngs: unused; accepted for BatchNorm's signature.
  """

  def __init__(self, num_features: int, *, use_running_average: bool = False,
               momentum: float = 0.99, epsilon: float = 1e-5, rngs: nnx.Rngs | None = None):
    del rngs
    self.scale = nnx.Param(jnp.ones((num_features,), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((num_features,), jnp.float32))
    self.mean = nnx.BatchStat(jnp.zeros((num_features,), jnp.float32))
    self.var = nnx.BatchStat(jnp.ones((num_features,), jnp.float32))
    self.use_running_average = use_running_average
    self.momentum, self.epsilon = momentum, epsilon

  def __call__(self, x, use_running_average: bool | None = None):
    running = self.use_running_average if use_running_average is None else use_running_average
    if running:
      mean, var = self.mean[...], self.var[...]
    else:
      axes = tuple(range(x.ndim - 1))
      moments = jnp.stack([jnp.mean(x, axes), jnp.mean(jnp.square(x), axes)]).astype(jnp.float32)
      mean, mean_square = ops.pmean(moments)
      var = jnp.maximum(mean_square - jnp.square(mean), 0.0)
      self.mean[...] = lax.stop_gradient(self.momentum * self.mean[...]
                                         + (1 - self.momentum) * mean)
      self.var[...] = lax.stop_gradient(self.momentum * self.var[...]
                                        + (1 - self.momentum) * var)
    normalized = (x - mean) * lax.rsqrt(var + self.epsilon)
    return (normalized * self.scale[...] + self.bias[...]).astype(x.dtype)
