"""Where a reduction is traced: in a per-replica step, or in a jit step over global arrays.

jdist's reductions (`psum`, `pmean`, `all_gather`, `allreduce`) run in one of
two contexts, told apart at trace time:

* **per replica**: inside `jdist.data_parallel` (a `shard_map` or `pmap`
  over the local devices), where `jdist.DATA_AXIS` is a bound axis and each
  device holds one replica's values. Reductions span every replica of the
  job: the local devices, then the processes.
* **global**: inside a plain `jax.jit` over global arrays, traced under
  `jax.set_mesh(jdist.mesh())` (a mesh with the axis `jdist.DATA_AXIS`):
  the batch is sharded over the data axis, parameters are replicated, and
  XLA already averages gradients over the mesh's devices. What is left is
  the exchange between the mesh's copies, one per process under MPI (none
  with the "jax" backend, whose mesh spans every process). `per_process`
  runs the per-replica reduction inside a `shard_map` over the mesh in
  which only the first device of each mesh contributes, so each process's
  value counts once.

`reduce_where` tells the two apart once, where a reduction is called, and
hands the reduction a `Span`: the route it takes, the axis of the local
devices and how many distinct values it combines (every replica, or every
process in a global step). Everything below passes the span on explicitly;
no context variable decides a route or a count.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdist import errors
from jdist.runtime import jit_steps
from jdist.runtime import topology as topology_lib
from jdist.collectives import mesh_axes
from jdist.collectives import routes
from jdist.collectives import start
from jdist.collectives import steps
from jdist.collectives.wire import DATA_AXIS


@dataclasses.dataclass(frozen=True)
class Span:
  """Where one reduction runs, decided where it is called and passed down.

  Attributes:
    route: the route its exchanges take across processes.
    participants: how many distinct values it combines: every replica in a
      per-replica step, every process (one mesh copy each) in a global step.
    global_step: whether it runs for a jit step over global arrays (inside
      `per_process`).
    axis: the mapped axis of the local devices the reduction runs over.
  """
  route: routes.Route
  participants: int
  global_step: bool = False
  axis: str = DATA_AXIS


def axis_mesh(devices) -> Mesh:
  """A one-axis mesh over `devices` whose axis is `DATA_AXIS`: every jdist mesh."""
  return Mesh(np.asarray(devices), (DATA_AXIS,))


def per_device_sharding(devices) -> NamedSharding:
  """Rows of the leading axis, one per device in `devices` (jdist's replicated layout)."""
  return NamedSharding(axis_mesh(devices), PartitionSpec(DATA_AXIS))


def mesh(model: int = 1, *, names: tuple[str, str] | None = None) -> Mesh:
  """The mesh jdist's global (jit) steps run over: a data axis, and optionally a model axis.

  The local devices of this process; with the "jax" backend (JAX's own
  multi-process runtime), every device of every process. Use it as
  `with jax.set_mesh(jdist.mesh()):` around the jitted step and for the
  step's shardings: `NamedSharding(mesh, P(jdist.DATA_AXIS))` for batches,
  `NamedSharding(mesh, P())` for parameters. Sets the job up (`jdist.init()`
  with defaults) where nothing has: a jit script starts here.

  With `model=K`, two axes (data, model) over rows of K local devices: XLA
  shards parameters over the model axis within the process (e.g.
  `P(None, "model")`), the data axis spans every process through jdist (see
  `jdist.collectives.mesh_axes` and docs/model_axis.md).

  Args:
    model: the model axis's size, dividing the local device count (1: the
      one-axis mesh, unless `names` asks for two axes).
    names: (data axis, model axis), e.g. `("batch", "model")`; default
      (`jdist.DATA_AXIS`, "model").

  Returns:
    A `jax.sharding.Mesh`.

  Raises:
    ValueError: `model` does not divide the local devices, exceeds them (a
      model axis cannot span processes), or bad `names`.
  """
  topo = start.ensure_initialized()
  devices = jax.devices() if topo.backend == "jax" else jax.local_devices()
  return mesh_axes.build(devices, topo.local_device_count, model, names)


def _global_mesh():
  """The abstract mesh of a global step being traced, or None."""
  abstract = jax.sharding.get_abstract_mesh()
  data = mesh_axes.data_axis(abstract)
  if data is not None and data not in abstract.manual_axes:
    return abstract
  return None


def in_global_step(what: str) -> bool:
  """True in a global (jit) step, False in a per-replica step.

  Raises:
    jdist.errors.CollectiveContextError: traced in neither: names the two ways.
  """
  try:
    lax.axis_index(DATA_AXIS)
    return False
  except NameError:
    pass
  if _global_mesh() is not None:
    return True
  raise errors.CollectiveContextError(
      f"{what} reduces over the replicas of a data-parallel step, so the function that "
      f"runs it must be wrapped by @jdist.data_parallel (a shard_map over the local "
      f"devices with axis name {DATA_AXIS!r}). It also runs inside jdist.dist_opt and "
      f"jdist.allreduce: if your train step calls tx.update and is decorated with "
      f"@jax.jit or @jax.pmap, decorate it with @jdist.data_parallel instead (it compiles "
      f"the step too), and give it parameters and optimizer state from jdist.replicate(...) "
      f"and batches from jdist.shard(batch). Or keep @jax.jit over global arrays and call "
      f"the step under `with jax.set_mesh(jdist.mesh()):`, with batches sharded as "
      f"NamedSharding(jdist.mesh(), P(jdist.DATA_AXIS)). For host-side values outside a "
      f"step, use jdist.broadcast_params, jdist.sync_params or jdist.host_allreduce.")


def reduce_where(what: str, reduce_fn: Callable[[Span, Any], Any], tree: Any, *,
                 first_only: bool = True, route: str | routes.Route | None = None) -> Any:
  """Runs `reduce_fn(span, tree)` as a reduction over every replica of either kind of step.

  In a `jdist.data_parallel` step, directly, over every replica; in a global
  (jit) step, once per process (`per_process`).

  Args:
    what: names the reduction in errors.
    reduce_fn: (`Span`, values) -> result, the same on every replica.
    tree: the step's values.
    first_only: see `per_process`.
    route: the route, or its name; None: the one `jdist.init()` chose for
      this kind of step (`Topology.route`).

  Raises:
    jdist.errors.CollectiveContextError: traced in neither kind of step.
    ValueError: `route` is not one this job can take.
  """
  on = route if isinstance(route, routes.Route) or route is None else start.route_named(route)
  if in_global_step(what):
    return per_process(reduce_fn, tree, first_only=first_only, on=on)
  return reduce_fn(Span(on or start.active_route(), topology_lib.current().replica_count), tree)


def per_process(reduce_fn: Callable[[Span, Any], Any], tree: Any, *, first_only: bool = True,
                on: routes.Route | None = None) -> Any:
  """Runs a per-replica reduction on values that every device of the mesh holds whole.

  Args:
    reduce_fn: the per-replica reduction, (`Span`, values) -> result, run
      inside a `shard_map` over the global step's mesh.
    tree: the step's values (replicated over the mesh, or sharded: the
      `shard_map` gathers them first).
    first_only: other devices than the mesh's first contribute zeros, so a
      sum counts each process's value once (False for gathers, which pick
      one row per process afterwards).
    on: the route (default: the one `jdist.init()` chose).

  Returns:
    `reduce_fn`'s result, the same on every device.
  """
  abstract = _global_mesh()
  over = mesh_axes.exchange_mesh(abstract)  # a model axis: all devices on one axis
  span = Span(on if on is not None else start.active_route(),
              topology_lib.current().replica_count // (
                  abstract.shape[DATA_AXIS] if over is None else over.size),
              global_step=True)

  def body(values, previous):
    if previous is not None:  # this reduction's exchanges wait for the step's earlier ones
      steps.chain_output(previous)
    if first_only:
      first = lax.axis_index(span.axis) == 0
      values = jax.tree.map(lambda x: jnp.where(first, x, jnp.zeros_like(x)), values)
    return reduce_fn(span, values), steps.chain_tail()

  # Each reduction is a shard_map of its own, so a trace of its own: the
  # callback route's chain (`steps`) orders exchanges within one trace only.
  # Two independent reductions of one step (the gradients' and the loss's)
  # then ran in different orders on the two processes, each device's MPI
  # call waiting for the other's (measured: 300 steps of the 2x2 global top-K
  # step aborted in XLA's rendezvous 3 runs in 3). Their tails carry the
  # order across.
  with (contextlib.nullcontext() if over is None
        else jax.sharding.use_abstract_mesh(over.abstract_mesh)), \
      steps.collect_unscoped() as ordinals:
    out, tail = jax.shard_map(body, mesh=over, in_specs=PartitionSpec(),
                              out_specs=PartitionSpec(), check_vma=False)(tree, steps.chain_tail())
  jit_steps.note_exchanges(ordinals)  # which jit step runs them (jdist.timeline)
  if tail is not None:
    steps.chain_output(tail)
  return out


def gather_rows_per_process(gathered: Any, span: Span) -> Any:
  """From a gather over every replica inside `per_process`, one row per process."""
  stride = topology_lib.current().replica_count // span.participants
  return jax.tree.map(lambda x: x[::stride], gathered)


def replica_index() -> jax.Array | int:
  """This replica's global index: in a step, per device; on the host, this process's.

  In a `jdist.data_parallel` step: `process_index * local_device_count +`
  the device's position (replicas are numbered process-major). In a global
  (jit) step and on the host, where one process is one participant: the
  process index.
  """
  topo = topology_lib.current()
  try:
    device = lax.axis_index(DATA_AXIS)
  except NameError:
    device = None
  if device is None and (_global_mesh() is None or not steps.tracing()):
    return topo.process_index  # on the host
  # In a step: a value XLA cannot fold, so every process compiles one program.
  process = start.route_named(None).process_index_value()
  if device is not None and _global_mesh() is None:
    return process * topo.local_device_count + device
  return process


def replica_key(key: jax.Array) -> jax.Array:
  """`key` folded with `replica_index()`: different random numbers per replica.

  For dropout and other per-example noise, which must differ between
  replicas (parameter initialization must not: use the same key there).
  """
  return jax.random.fold_in(key, replica_index())
