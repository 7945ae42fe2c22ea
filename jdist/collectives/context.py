"""The step context: where a reduction is traced, over which mesh and route.

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

The job's route comes from the job (`jdist.runtime.job.Job.route`), read
once per reduction; `Span` carries it and its replica count down.

**A model axis** (`jdist.mesh(model=K)`): a data axis across processes
beside a model axis within one. `jdist.mesh()` is one axis, `jdist.DATA_AXIS`, over the local devices. With
`model=K` it is two, (data, model): rows of K consecutive local devices.
XLA shards parameters over the model axis (`NamedSharding(mesh, P(None,
"model"))`) and the batch over the data axis within the process, and
computes each process's gradient, laid out like its parameter; jdist adds
the exchange between processes. The model axis never leaves a process:
jdist's cross-process exchange runs on the data axis only.

A global step's reduction (`per_process`) runs in
a `shard_map` where a one-axis mesh names each device: jdist's routes reduce
over `DATA_AXIS` and key each device's cross-process exchange by its place
on that axis. Over the two-axis mesh, the devices of one model row share a
data index, so they would run their exchanges on one MPI communicator at
once and could pair with another process's device of a different shard
(silently wrong sums). So the reduction runs over `exchange_mesh`: the same
devices, data-major, as one `DATA_AXIS` axis. Its input is the whole value
(XLA gathers a model-sharded gradient over its row first); the mesh's first
device contributes it and every device gets the process sum back, which XLA
lays out again as the parameter's shard. Every shard is thus summed with the
same shard of every other process, and compressed payloads (top-K, PowerSGD,
16-bit) travel as they do without a model axis.

The data axis may carry another name (`names=("batch", "model")`, the
axis names of JAX's miniGPT tutorial): jdist remembers which axis of each
mesh it built is the data axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jdist import errors
from jdist.collectives import routes
from jdist.collectives.routes import base
from jdist.collectives.routes.base import DATA_AXIS
from jdist.runtime import jit_steps
from jdist.runtime import job as job_lib


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


MODEL_AXIS = "model"


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What jdist reads from a two-axis mesh it built."""
  data: str        # the data axis's name
  model: str       # the model axis's name
  exchange: Mesh   # the same devices, data-major, on the one axis DATA_AXIS


# Keyed by the abstract mesh, which is all a traced step sees of its mesh.
_layouts: dict[AbstractMesh, _Layout] = {}


def _divisors(n: int) -> tuple[int, ...]:
  return tuple(k for k in range(1, n + 1) if n % k == 0)


def _check(model, names, local: int) -> tuple[str, str] | None:
  """The checked `names` (None: the one-axis mesh), or a ValueError naming what is wrong."""
  if isinstance(model, bool) or not isinstance(model, (int, np.integer)) or model < 1:
    raise ValueError(f"model={model!r} must be a positive int: the model axis's size "
                     f"(1: no model axis).")
  if model > local:
    raise ValueError(
        f"model={model} is more than this process's {local} local devices: the model axis "
        f"shards parameters within one process, never across processes (jdist's exchange "
        f"between processes runs on the data axis only). Choose model in "
        f"{_divisors(local)}, or run fewer processes with more devices each.")
  if local % model:
    raise ValueError(
        f"model={model} does not divide this process's {local} local devices into whole "
        f"model rows (the data axis has local_devices / model slots per process). Choose "
        f"model in {_divisors(local)}.")
  if names is None:
    return None if model == 1 else (DATA_AXIS, MODEL_AXIS)
  if (isinstance(names, str) or not isinstance(names, Sequence) or len(names) != 2
      or not all(isinstance(n, str) and n for n in names) or names[0] == names[1]):
    raise ValueError(f"names={names!r} must be two different axis names, (data, model), "
                     f"e.g. ('batch', 'model').")
  if names[1] == DATA_AXIS:
    raise ValueError(f"names={tuple(names)!r} names the model axis {DATA_AXIS!r}, which jdist "
                     f"reads as the data axis (jdist.DATA_AXIS); name it e.g. "
                     f"{MODEL_AXIS!r}.")
  return tuple(names)


def build_mesh(devices: Sequence[jax.Device], local: int, model: int = 1,
          names: Sequence[str] | None = None) -> Mesh:
  """The mesh of `jdist.mesh(model, names)` over `devices`.

  Args:
    devices: the devices of the mesh (this process's; with the "jax"
      backend, every process's, process by process).
    local: local devices per process.
    model: the model axis's size; it must divide `local`.
    names: (data axis, model axis); None: (`DATA_AXIS`, "model"), or the
      one-axis mesh where `model` is 1.

  Returns:
    A `Mesh`: one axis `DATA_AXIS`, or (data, model) of shape
    [len(devices) / model, model].

  Raises:
    ValueError: a bad `model` or `names` (see `jdist.mesh`).
  """
  checked = _check(model, names, local)
  flat = np.asarray(devices)
  if checked is None:
    return Mesh(flat, (DATA_AXIS,))
  grid = flat.reshape(-1, model)
  rows = {tuple(sorted({d.process_index for d in row})) for row in grid}
  if any(len(r) != 1 for r in rows):  # the devices are not grouped by process
    raise ValueError(f"model={model}: a model row would span processes "
                     f"({[list(r) for r in grid]}); jdist's model axis stays within one.")
  built = Mesh(grid, checked)
  _layouts[built.abstract_mesh] = _Layout(checked[0], checked[1], Mesh(flat, (DATA_AXIS,)))
  return built


def data_axis(abstract: AbstractMesh) -> str | None:
  """The data axis of a global step's mesh, or None where it has none.

  Raises:
    jdist.errors.CollectiveContextError: a mesh with `DATA_AXIS` and other
      axes that `jdist.mesh` did not build (jdist would not know how its
      devices exchange across processes).
  """
  layout = _layouts.get(abstract)
  if layout is not None:
    return layout.data
  if DATA_AXIS not in abstract.axis_names:
    return None
  if len(abstract.axis_names) > 1 and DATA_AXIS not in abstract.manual_axes:
    raise errors.CollectiveContextError(
        f"jdist's reductions run in a jit step over a mesh with axes {abstract.axis_names} "
        f"that jdist.mesh did not build. Build it with jdist.mesh(model=K) (axes "
        f"({DATA_AXIS!r}, {MODEL_AXIS!r})) or jdist.mesh(model=K, names=(data, model)): "
        f"jdist then knows which axis spans processes.")
  return DATA_AXIS


def exchange_mesh(abstract: AbstractMesh) -> Mesh | None:
  """The one-axis mesh a global step's reduction runs over; None: the step's own mesh."""
  layout = _layouts.get(abstract)
  return None if layout is None else layout.exchange


def refuse_per_replica_step(what: str) -> None:
  """Raises where a `jdist.data_parallel` step is called under a two-axis jdist mesh.

  Such a step makes each local device a replica holding whole parameters:
  it has no model axis, and JAX refuses its one-axis `shard_map` under the
  two-axis context mesh with a message that names neither.

  Raises:
    jdist.errors.CollectiveContextError: names both ways out.
  """
  abstract = jax.sharding.get_abstract_mesh()
  layout = _layouts.get(abstract)
  if layout is None or abstract.manual_axes:
    return
  raise errors.CollectiveContextError(
      f"{what} is a jdist.data_parallel step (every local device a replica with whole "
      f"parameters), called under jax.set_mesh(jdist.mesh(model="
      f"{abstract.shape[layout.model]}, ...)), whose model axis {layout.model!r} it cannot "
      f"use. For a model axis, write the step as a jax.jit step over global arrays under "
      f"that mesh (docs/model_axis.md); for data parallelism alone, call this step outside "
      f"it (under jax.set_mesh(jdist.mesh()) or no mesh).")


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
  the module doc and docs/model_axis.md).

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
  topo = routes.ensure_job().topology
  devices = jax.devices() if topo.backend == "jax" else jax.local_devices()
  return build_mesh(devices, topo.local_device_count, model, names)


def _global_mesh():
  """The abstract mesh of a global step being traced, or None."""
  abstract = jax.sharding.get_abstract_mesh()
  data = data_axis(abstract)
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
  on = _route(route)
  if in_global_step(what):
    return per_process(reduce_fn, tree, first_only=first_only, on=on)
  return reduce_fn(Span(on, on.replicas), tree)


def _route(route: str | routes.Route | None) -> routes.Route:
  """The route object of `route`: the job's for None, by name for a name."""
  if isinstance(route, routes.Route):
    return route
  job = job_lib.get()
  if route is None and job is not None:
    return job.route
  return routes.named(route)


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
  over = exchange_mesh(abstract)  # a model axis: all devices on one axis
  on = on if on is not None else routes.active()
  span = Span(on, on.replicas // (
                  abstract.shape[DATA_AXIS] if over is None else over.size),
              global_step=True)

  def body(values, previous):
    if previous is not None:  # this reduction's exchanges wait for the step's earlier ones
      base.chain_output(previous)
    if first_only:
      first = lax.axis_index(span.axis) == 0
      values = jax.tree.map(lambda x: jnp.where(first, x, jnp.zeros_like(x)), values)
    return reduce_fn(span, values), base.chain_tail()

  # Each reduction is a shard_map of its own, so a trace of its own: the
  # callback route's chain (`steps`) orders exchanges within one trace only.
  # Two independent reductions of one step (the gradients' and the loss's)
  # then ran in different orders on the two processes, each device's MPI
  # call waiting for the other's (measured: 300 steps of the 2x2 global top-K
  # step aborted in XLA's rendezvous 3 runs in 3). Their tails carry the
  # order across.
  with (contextlib.nullcontext() if over is None
        else jax.sharding.use_abstract_mesh(over.abstract_mesh)), \
      base.collect_unscoped() as ordinals:
    out, tail = jax.shard_map(body, mesh=over, in_specs=PartitionSpec(),
                              out_specs=PartitionSpec(), check_vma=False)(tree, base.chain_tail())
  jit_steps.note_exchanges(ordinals)  # which jit step runs them (jdist.timeline)
  if tail is not None:
    base.chain_output(tail)
  return out


def gather_rows_per_process(gathered: Any, span: Span) -> Any:
  """From a gather over every replica inside `per_process`, one row per process."""
  stride = span.route.replicas // span.participants
  return jax.tree.map(lambda x: x[::stride], gathered)


def replica_index() -> jax.Array | int:
  """This replica's global index: in a step, per device; on the host, this process's.

  In a `jdist.data_parallel` step: `process_index * local_device_count +`
  the device's position (replicas are numbered process-major). In a global
  (jit) step and on the host, where one process is one participant: the
  process index.
  """
  topo = job_lib.current()
  try:
    device = lax.axis_index(DATA_AXIS)
  except NameError:
    device = None
  if device is None and (_global_mesh() is None or not base.tracing()):
    return topo.process_index  # on the host
  # In a step: a value XLA cannot fold, so every process compiles one program.
  process = routes.active().process_index_value()
  if device is not None and _global_mesh() is None:
    return process * topo.local_device_count + device
  return process


def replica_key(key: jax.Array) -> jax.Array:
  """`key` folded with `replica_index()`: different random numbers per replica.

  For dropout and other per-example noise, which must differ between
  replicas (parameter initialization must not: use the same key there).
  """
  return jax.random.fold_in(key, replica_index())
