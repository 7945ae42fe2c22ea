"""Running a step on every local device: `data_parallel` and placement helpers.

`data_parallel(fn)` is `jax.pmap(fn, axis_name=jdist.DATA_AXIS)` with three
additions: it checks that mapped inputs carry one slice per local device
(pmap would otherwise silently run on fewer devices, and averages would be
divided by the wrong replica count), it tells the watchdog when a step is
dispatched, and it initializes jdist at its first call if the user has not
(decorating initializes nothing).
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdist import errors
from jdist import topology as topology_lib
from jdist.collectives import steps
from jdist.collectives import world as world_lib
from jdist.collectives.transport import DATA_AXIS


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
    for path, leaf in jax.tree_util.tree_leaves_with_path(args[position]):
      shape = np.shape(leaf)
      if not shape or shape[0] != devices:
        got = "a scalar" if not shape else f"leading size {shape[0]}"
        raise errors.ShapeError(
            f"{name}: argument {position}{jax.tree_util.keystr(path)} has {got}, but "
            f"data_parallel maps over the {devices} local devices, so every mapped "
            f"input needs a leading axis of size {devices}. Split this process's "
            f"batch with jdist.shard(batch) (its size must be a multiple of {devices}; "
            f"a global batch that every process holds: "
            f"jdist.shard(jdist.process_slice(batch))), put parameters on every "
            f"device with jdist.replicate(params), or mark unmapped arguments with "
            f"in_axes=None / static_broadcasted_argnums.")


# XLA:CPU deadlocks when the host runs too far ahead: each device admits 32
# in-flight computations, launches past that block client pool threads, and
# with a pool of max(cores, devices) threads a step's collective can then wait
# for a device whose execution never gets a thread (a rendezvous timeout and
# abort after 40 s), in one process as in several. Waiting for step n-8
# before dispatching step n keeps the queue short and costs nothing on GPUs.
MAX_INFLIGHT_STEPS = 8
_inflight: collections.deque = collections.deque()
_inflight_lock = threading.Lock()


def _limit_inflight(marker) -> None:
  with _inflight_lock:
    _inflight.append(marker)
    oldest = _inflight.popleft() if len(_inflight) > MAX_INFLIGHT_STEPS else None
  if oldest is not None:
    oldest.block_until_ready()


def data_parallel(fn: Callable | None = None, *, donate_argnums: int | Sequence[int] = (),
                  static_broadcasted_argnums: int | Sequence[int] = (), in_axes: Any = 0,
                  out_axes: Any = 0, check_inputs: bool = True) -> Callable:
  """Runs `fn` on every local device, as one data-parallel replica each.

  Inside `fn`, `jdist.psum`/`jdist.pmean`/`jdist.allreduce` reduce over every
  replica of the job (all local devices of all processes).

  Args:
    fn: the per-replica step. Usable as `@data_parallel` or
      `@data_parallel(donate_argnums=...)`.
    donate_argnums: as in `jax.pmap`.
    static_broadcasted_argnums: as in `jax.pmap`.
    in_axes: as in `jax.pmap`.
    out_axes: as in `jax.pmap`.
    check_inputs: check that mapped inputs have one slice per local device.

  Returns:
    The pmapped function.
  """
  if fn is None:
    return functools.partial(
        data_parallel, donate_argnums=donate_argnums,
        static_broadcasted_argnums=static_broadcasted_argnums, in_axes=in_axes,
        out_axes=out_axes, check_inputs=check_inputs)
  static = ((static_broadcasted_argnums,) if isinstance(static_broadcasted_argnums, int)
            else tuple(static_broadcasted_argnums))

  name = getattr(fn, "__name__", "step")

  def with_marker(*args):
    # A tiny extra output whose readiness tells the watchdog the step ended;
    # the user's own outputs may be donated to the next step. The scope
    # numbers the step's exchanges (the native route names them so).
    with steps.step_scope(name):
      return fn(*args), jnp.zeros((), jnp.int8)

  pmapped = jax.pmap(with_marker, axis_name=DATA_AXIS,
                     in_axes=in_axes, out_axes=(out_axes, 0),
                     static_broadcasted_argnums=static, donate_argnums=donate_argnums)

  @functools.wraps(fn)
  def step(*args):
    # Looked up per call, not at decoration: a module-level @data_parallel
    # must leave the user's later jdist.init(...) free to set the job up.
    topo = topology_lib.current()
    if check_inputs:
      check_mapped_inputs(args, _mapped_positions(in_axes, len(args), static),
                          topo.local_device_count, name)
    outputs, marker = pmapped(*args)
    _limit_inflight(marker)
    world = world_lib.get()
    if world is not None and world.size > 1:
      world.watchdog.step_dispatched(marker, name)
    return outputs

  step.pmapped = pmapped
  return step


def _local_mesh() -> Mesh:
  return Mesh(np.array(jax.local_devices()), (DATA_AXIS,))


def replicate(tree: Any) -> Any:
  """Puts a copy of every leaf on each local device (leading device axis)."""
  devices = jax.local_devices()
  sharding = NamedSharding(_local_mesh(), PartitionSpec(DATA_AXIS))

  def put(leaf):
    leaf = jnp.asarray(leaf)
    pieces = [jax.device_put(leaf[None], d) for d in devices]
    return jax.make_array_from_single_device_arrays((len(devices),) + leaf.shape, sharding, pieces)

  return jax.tree.map(put, tree)


def unreplicate(tree: Any) -> Any:
  """The first local device's copy of every leaf (drops the device axis)."""
  def first(leaf):
    if isinstance(leaf, jax.Array) and leaf.addressable_shards:
      shard = min(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
      return shard.data[0] if shard.data.shape[0] == 1 else leaf[0]
    return leaf[0]
  return jax.tree.map(first, tree)


def local_replicas(tree: Any) -> list[Any]:
  """Host copies of the tree on each local device, in device order."""
  host = jax.device_get(tree)
  count = topology_lib.current().local_device_count
  return [jax.tree.map(lambda x, i=i: x[i], host) for i in range(count)]
