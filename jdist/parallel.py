"""Running a step on every local device: `data_parallel` and placement helpers.

`data_parallel(fn)` keeps `jax.pmap`'s calling convention (mapped inputs and
outputs carry a leading axis of one slice per local device) and runs as
`jax.jit(jax.shard_map(fn, mesh of the local devices, axis jdist.DATA_AXIS))`,
pmap itself being in maintenance mode since JAX 0.8. It adds: a check that
mapped inputs carry one slice per local device (else averages would be
divided by the wrong replica count), a signal to the watchdog when a step
is dispatched, and jdist's initialization at its first call if the user has
not (decorating initializes nothing).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jdist.collectives.routes import base
from jdist.data import batches
from jdist.runtime import job as job_lib
from jdist.collectives import context
from jdist.collectives import ops
from jdist.collectives import routes
from jdist.collectives.routes.base import DATA_AXIS


def _mapped_positions(in_axes, num_args: int, static: Sequence[int]) -> list[int]:
  if in_axes == 0:
    positions = list(range(num_args))
  elif isinstance(in_axes, (tuple, list)):
    positions = [i for i, axis in enumerate(in_axes) if axis == 0]
  else:
    return []  # custom in_axes: pmap itself checks them
  return [i for i in positions if i not in static]


def check_mapped_inputs(args: Sequence[Any], positions: Sequence[int], devices: int,
                        name: str) -> None:
  """Raises ShapeError unless every mapped leaf has leading size `devices`."""
  for position in positions:
    # Runs before every step: the message (paths, text) is built only for a bad leaf.
    if all(np.shape(leaf)[:1] == (devices,) for leaf in jax.tree.leaves(args[position])):
      continue
    for path, leaf in jax.tree_util.tree_leaves_with_path(args[position]):
      problem = batches.leading_axis_error(
          f"{name}: argument {position}{jax.tree_util.keystr(path)}", np.shape(leaf), devices,
          f"data_parallel maps over the {devices} local devices, so every mapped "
          f"input needs a leading axis of size {devices}. Split this process's "
          f"batch with jdist.shard(batch) (its size must be a multiple of {devices}; "
          f"a global batch that every process holds: "
          f"jdist.shard(jdist.process_slice(batch))), put parameters on every "
          f"device with jdist.replicate(params), or mark unmapped arguments with "
          f"in_axes=None / static_broadcasted_argnums.")
      if problem is not None:
        raise problem


# XLA:CPU deadlocks when the host runs too far ahead: each device admits 32
# in-flight computations, launches past that block client pool threads, and
# with a pool of max(cores, devices) threads a step's collective can then wait
# for a device whose execution never gets a thread (a rendezvous timeout and
# abort after 40 s), in one process as in several. Waiting for step n-8
# before dispatching step n keeps the queue short and costs nothing on GPUs.
# One queue for every step: XLA's limit is per device, shared by all of them.
MAX_INFLIGHT_STEPS = 8
_inflight: collections.deque = collections.deque()
_inflight_lock = threading.Lock()


def _limit_inflight(marker) -> None:
  with _inflight_lock:
    _inflight.append(marker)
    oldest = _inflight.popleft() if len(_inflight) > MAX_INFLIGHT_STEPS else None
  if oldest is not None:
    oldest.block_until_ready()


def _axis_flags(in_axes: Any, positions: Sequence[int]) -> tuple[bool, ...]:
  """For each dynamic argument: mapped over the devices (True) or replicated."""
  if in_axes in (0, None):
    return tuple(in_axes == 0 for _ in positions)
  if isinstance(in_axes, (tuple, list)) and all(axis in (0, None) for axis in in_axes):
    return tuple(in_axes[i] == 0 if i < len(in_axes) else True for i in positions)
  raise ValueError(f"in_axes={in_axes!r}: data_parallel maps arguments over axis 0 or not "
                   f"at all; use 0, None, or a tuple of 0/None per argument.")


def _spec(mapped: bool) -> PartitionSpec:
  return PartitionSpec(DATA_AXIS) if mapped else PartitionSpec()


def _with_device_axis(tree: Any) -> Any:
  return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)


def _commit_to_mesh(args: list, positions: Sequence[int], flags: Sequence[bool]) -> list:
  """Moves arrays committed to one device onto the local devices.

  jit refuses an argument committed to another set of devices, where pmap
  copied it; an array from `unreplicate` or `jax.device_put(x, device)` is
  one.
  """
  def place(leaf, mapped):
    if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, SingleDeviceSharding):
      return jax.device_put(leaf, NamedSharding(_local_mesh(), _spec(mapped)))
    return leaf

  for position, mapped in zip(positions, flags):
    args[position] = jax.tree.map(lambda leaf, m=mapped: place(leaf, m), args[position])
  return args


def data_parallel(fn: Callable | None = None, *, donate_argnums: int | Sequence[int] = (),
                  static_broadcasted_argnums: int | Sequence[int] = (), in_axes: Any = 0,
                  out_axes: Any = 0, check_inputs: bool = True) -> Callable:
  """Runs `fn` on every local device, as one data-parallel replica each.

  The calling convention is `jax.pmap`'s: mapped inputs and outputs carry a
  leading axis of one slice per local device. Underneath it is
  `jax.jit(jax.shard_map(...))` over a mesh of the local devices with axis
  `jdist.DATA_AXIS` (with the "jax" backend across processes, `jax.pmap`,
  which spans every process's devices). Inside `fn`, `jdist.psum`/`jdist.pmean`/`jdist.allreduce`
  reduce over every replica of the job (all local devices of all processes).

  Args:
    fn: the per-replica step. Usable as `@data_parallel` or
      `@data_parallel(donate_argnums=...)`.
    donate_argnums: arguments whose buffers the step may reuse.
    static_broadcasted_argnums: hashable arguments passed as Python values
      (a change recompiles), as in `jax.pmap`.
    in_axes: 0 (every argument mapped over the devices), None (every
      argument replicated), or a tuple of 0/None per argument.
    out_axes: 0 (outputs carry the device axis), None (outputs are the
      same on every device, such as a `jdist.pmean`'d loss, and come back
      without it), or a tuple of 0/None per element of a tuple output.
    check_inputs: check that mapped inputs have one slice per local device.

  Returns:
    The compiled per-device step.

  Raises:
    ValueError: in_axes or out_axes other than 0/None (per argument or output).
  """
  if fn is None:
    return functools.partial(
        data_parallel, donate_argnums=donate_argnums,
        static_broadcasted_argnums=static_broadcasted_argnums, in_axes=in_axes,
        out_axes=out_axes, check_inputs=check_inputs)
  static = ((static_broadcasted_argnums,) if isinstance(static_broadcasted_argnums, int)
            else tuple(static_broadcasted_argnums))
  _check_out_axes(out_axes)
  _axis_flags(in_axes, [])  # checks in_axes now, not at the first call
  name = getattr(fn, "__name__", "step")
  compiled = _compile_on_local_mesh(_per_device_step(fn, name, out_axes), static,
                                    donate_argnums, in_axes, out_axes)
  # With the "jax" backend the step spans every process's devices; pmap
  # builds those global arrays from each process's slices, so it stays there.
  multi_process_pmap = functools.cache(lambda: _pmap_over_processes(
      fn, name, static, donate_argnums, in_axes, out_axes))

  @functools.wraps(fn)
  def step(*args):
    # Looked up per call, not at decoration: a module-level @data_parallel
    # must leave the user's later jdist.init(...) free to set the job up.
    job = job_lib.get() or routes.ensure_job()  # initializes on a first call only
    topo = job.topology
    context.refuse_per_replica_step(name)  # a model axis it cannot use: say so, not JAX
    if check_inputs:
      check_mapped_inputs(args, _mapped_positions(in_axes, len(args), static),
                          topo.local_device_count, name)
    if topo.backend == "jax" and topo.process_count > 1:
      outputs, marker = multi_process_pmap()(*args)
    else:
      if topo.local_device_count > 1:
        positions = [i for i in range(len(args)) if i not in static]
        args = _commit_to_mesh(list(args), positions, _axis_flags(in_axes, positions))
      outputs, marker = compiled(*args)
    _limit_inflight(marker)
    job.step_dispatched(marker, name)
    return outputs

  step.compiled = compiled
  step.pmapped = compiled  # the name older code and tests use
  return step


def _check_out_axes(out_axes: Any) -> None:
  """Raises ValueError unless `out_axes` is 0, None or a tuple of 0/None."""
  if not (out_axes in (0, None) or (isinstance(out_axes, tuple)
                                    and all(axis in (0, None) for axis in out_axes))):
    raise ValueError(f"out_axes={out_axes!r}: use 0 (per-device outputs), None (outputs "
                     f"identical on every device, e.g. a pmean'd loss) or a tuple of 0/None "
                     f"per element of a tuple output.")


def _with_out_axes(out: Any, out_axes: Any, name: str) -> Any:
  """`out` with pmap's device axis added to each output `out_axes` maps (0).

  Raises:
    ValueError: a tuple `out_axes` and an output that is not a tuple of that length.
  """
  if isinstance(out_axes, tuple):
    if not isinstance(out, tuple) or len(out) != len(out_axes):
      raise ValueError(f"{name}: out_axes={out_axes!r} needs a tuple of {len(out_axes)} "
                       f"outputs; the step returned {type(out).__name__}.")
    return tuple(_with_device_axis(x) if axis == 0 else x for x, axis in zip(out, out_axes))
  if out_axes == 0:
    return _with_device_axis(out)
  return out


def _note_trace(name: str, args: Any) -> None:
  """Tells the job step `name` is traced (a step compiled outside its call: no job yet)."""
  job = job_lib.get()
  if job is not None:
    job.step_traced(name, args)


def _per_device_step(fn: Callable, name: str, out_axes: Any) -> Callable:
  """The shard_map body: `fn` on one device's arguments, pmap's output axes, an end marker.

  The body takes a layout (per argument, ("static", value), ("mapped", i) or
  ("replicated", i), i among the dynamic arguments) and the dynamic
  arguments, and returns `fn`'s outputs with a tiny extra output whose
  readiness tells the watchdog the step ended (the user's own outputs may be
  donated to the next step).
  """
  def per_device(layout: tuple, *dynamic):
    args = []
    for kind, item in layout:
      if kind == "static":
        args.append(item)
      elif kind == "mapped":  # this device's slice, without pmap's device axis
        args.append(jax.tree.map(lambda x: x[0], dynamic[item]))
      else:
        args.append(dynamic[item])
    _note_trace(name, args)
    with base.step_scope(name):  # numbers the step's exchanges (the native route's names)
      out = fn(*args)
    return _with_out_axes(out, out_axes, name), jnp.zeros((1,), jnp.int8)

  return per_device


def _compile_on_local_mesh(per_device: Callable, static: tuple[int, ...],
                           donate_argnums: int | Sequence[int], in_axes: Any,
                           out_axes: Any) -> Callable:
  """`jax.jit(jax.shard_map(per_device))` over this process's devices.

  Takes the step's arguments as pmap would (static ones as Python values)
  and returns (outputs, end marker).
  """
  @functools.partial(jax.jit, static_argnums=static, donate_argnums=donate_argnums)
  def compiled(*args):
    positions = [i for i in range(len(args)) if i not in static]
    flags = _axis_flags(in_axes, positions)
    index = {position: i for i, position in enumerate(positions)}  # among dynamic args
    layout = tuple(("static", args[p]) if p in static else
                   ("mapped" if flags[index[p]] else "replicated", index[p])
                   for p in range(len(args)))
    mapped_out = (tuple(_spec(axis == 0) for axis in out_axes) if isinstance(out_axes, tuple)
                  else _spec(out_axes == 0))
    return jax.shard_map(
        functools.partial(per_device, layout), mesh=_local_mesh(),
        in_specs=tuple(_spec(mapped) for mapped in flags),
        out_specs=(mapped_out, PartitionSpec(DATA_AXIS)),
        check_vma=False)(*[args[i] for i in positions])

  return compiled


def _pmap_over_processes(fn: Callable, name: str, static: tuple[int, ...],
                         donate_argnums: int | Sequence[int], in_axes: Any,
                         out_axes: Any) -> Callable:
  """`jax.pmap(fn)` over every process's devices, returning (outputs, end marker)."""
  def with_marker(*args):
    _note_trace(name, args)
    with base.step_scope(name):
      return fn(*args), jnp.zeros((), jnp.int8)

  return jax.pmap(with_marker, axis_name=DATA_AXIS, in_axes=in_axes, out_axes=(out_axes, 0),
                  static_broadcasted_argnums=static, donate_argnums=donate_argnums)


def _local_mesh() -> Mesh:
  return context.axis_mesh(jax.local_devices())


def _outside_mesh():
  """A context without the mesh `jax.set_mesh(jdist.mesh())` may have set.

  The host helpers index arrays that live on one device (a replica's copy);
  under a context mesh of several devices, jit refuses such an operand
  ("Received incompatible devices for jitted computation"). Inside a trace
  (where `jax.set_mesh` is refused) nothing changes.
  """
  try:
    return jax.set_mesh(None)
  except ValueError:  # called while tracing
    return contextlib.nullcontext()


def replicate(tree: Any) -> Any:
  """Puts a copy of every leaf on each local device (leading device axis)."""
  devices = jax.local_devices()
  sharding = context.per_device_sharding(devices)

  def put(leaf):
    leaf = jnp.asarray(leaf)
    pieces = [jax.device_put(leaf[None], d) for d in devices]
    return jax.make_array_from_single_device_arrays((len(devices),) + leaf.shape, sharding, pieces)

  with _outside_mesh():
    return jax.tree.map(put, tree)


def unreplicate(tree: Any) -> Any:
  """The first local device's copy of every leaf (drops the device axis).

  Works with or without a global mesh set by `jax.set_mesh(jdist.mesh())`.
  """
  def first(leaf):
    if isinstance(leaf, jax.Array) and leaf.addressable_shards:
      shard = min(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
      return shard.data[0] if shard.data.shape[0] == 1 else leaf[0]
    return leaf[0]

  with _outside_mesh():
    return jax.tree.map(first, tree)


def local_replicas(tree: Any) -> list[Any]:
  """Host copies of the tree on each local device, in device order."""
  host = jax.device_get(tree)
  count = job_lib.current().local_device_count
  return [jax.tree.map(lambda x, i=i: x[i], host) for i in range(count)]


@functools.lru_cache(maxsize=None)
def _pmean_step():
  # Built on first use: decorating needs no jdist.init().
  return data_parallel(ops.pmean)


def sync_params(params: Any) -> Any:
  """Averages replicated parameters over every replica, all at once.

  Host side, between steps: before evaluation or a checkpoint under partial
  synchronization. Afterwards every replica holds identical values.

  Args:
    params: parameters replicated on the local devices (leading device axis).

  Returns:
    The averaged parameters, replicated the same way.
  """
  return _pmean_step()(params)
