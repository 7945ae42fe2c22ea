"""`jax.experimental.multihost_utils` over MPI, for a CPU client without Gloo.

Under mpirun jdist starts JAX's distributed runtime for JAX's process
identity but gives XLA's CPU client no cross-process collectives
(`jax_distributed.start`): with Gloo, XLA ran every collective through TCP,
a sum between two devices of one process included (a 2x2 CNN step took
1.9-2.0x the same step without it, 4.3 MB per step over the loopback), and
Gloo could not start where host names do not resolve. Without it, XLA sums
inside a process over shared memory, and jdist's own routes cross processes
as before.

The computations that do span processes in JAX's CPU client are the host
utilities of `jax.experimental.multihost_utils`: `process_allgather` (and
`sync_global_devices` and `assert_equal`, built on it) and
`broadcast_one_to_all`. Without collectives XLA refuses them ("Multiprocess
computations aren't implemented on the CPU backend"), so `install()` puts
versions with the same contract in their place that exchange over the MPI
world, under the watchdog's deadline. orbax and other libraries call them
through the module, so they get these too. On another backend (GPU, whose
collectives are NCCL's) the originals run.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

_originals: dict[str, Any] = {}
_world = None  # the MPI world `install` was given


def _world_for_cpu():
  """The MPI world when this job's default backend is the CPU, else None."""
  if _world is None or _world.size == 1 or jax.default_backend() != "cpu":
    return None
  return _world


def _global_value(array: jax.Array, world) -> np.ndarray:
  """The whole value of a global array whose shards live on several processes."""
  mine = [(shard.index, np.asarray(shard.data)) for shard in array.addressable_shards
          if shard.replica_id == 0]
  out = np.empty(array.shape, array.dtype)
  for shards in world.allgather_object(mine, "multihost_utils.process_allgather (global array)"):
    for index, data in shards:
      out[index] = data
  return out


def _check_shapes(parts: list[np.ndarray], what: str) -> None:
  shapes = [part.shape for part in parts]
  if len(set(shapes)) > 1:
    listed = ", ".join(f"rank {rank} {shape}" for rank, shape in enumerate(shapes))
    raise ValueError(f"{what}: every process must pass arrays of one shape; got {listed}.")


def process_allgather(in_tree: Any, tiled: bool = False) -> Any:
  """`multihost_utils.process_allgather`: every process's arrays, gathered.

  Args:
    in_tree: a pytree of arrays, each the same shape on every process.
    tiled: concatenate along axis 0 instead of stacking on a new axis 0.

  Returns:
    A pytree of numpy arrays: a global (not fully addressable) array's whole
    value; otherwise every process's array stacked (or, with `tiled`,
    concatenated; scalars are always stacked).

  Raises:
    ValueError: a global array with `tiled=False` (as JAX), or arrays of
      different shapes on different processes.
  """
  world = _world_for_cpu()
  if world is None:
    return _originals["process_allgather"](in_tree, tiled=tiled)
  leaves, treedef = jax.tree.flatten(in_tree)
  out: list[Any] = [None] * len(leaves)
  local = {}
  for index, leaf in enumerate(leaves):
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
      if not tiled:
        raise ValueError("Gathering global non-fully-addressable arrays only supports tiled=True")
      out[index] = _global_value(leaf, world)
    else:
      host = np.asarray(leaf)
      local[index] = host[None] if host.ndim == 0 or not tiled else host
  if local:
    gathered = world.allgather_object(local, "multihost_utils.process_allgather")
    for index in local:
      parts = [per_rank[index] for per_rank in gathered]
      _check_shapes(parts, "multihost_utils.process_allgather")
      out[index] = np.concatenate(parts, axis=0)
  return jax.tree.unflatten(treedef, out)


def broadcast_one_to_all(in_tree: Any, is_source: bool | None = None) -> Any:
  """`multihost_utils.broadcast_one_to_all`: the source process's arrays on every process.

  Args:
    in_tree: a pytree of arrays, each the same shape on every process.
    is_source: whether this process is a source; None: process 0 is. As in
      JAX, the result is the sum of the sources' values (zeros if none).

  Returns:
    A pytree of numpy arrays.
  """
  world = _world_for_cpu()
  if world is None:
    return _originals["broadcast_one_to_all"](in_tree, is_source=is_source)
  if is_source is None:
    is_source = world.rank == 0
  leaves, treedef = jax.tree.flatten(in_tree)
  host = [np.asarray(leaf) for leaf in leaves]
  sent = world.allgather_object(host if is_source else None,
                                "multihost_utils.broadcast_one_to_all")
  sources = [values for values in sent if values is not None]
  if len(sources) == 1:
    return jax.tree.unflatten(treedef, sources[0])
  summed = [np.zeros_like(leaf) for leaf in host]
  for values in sources:
    summed = [np.add(total, value, dtype=total.dtype) for total, value in zip(summed, values)]
  return jax.tree.unflatten(treedef, summed)


def install(world) -> None:
  """Puts the MPI versions in `jax.experimental.multihost_utils` (idempotent).

  Args:
    world: the started `jdist.runtime.world.MpiWorld` they exchange over.
  """
  global _world
  _world = world
  for name, replacement in (("process_allgather", process_allgather),
                            ("broadcast_one_to_all", broadcast_one_to_all)):
    current = getattr(multihost_utils, name)
    if current is not replacement:
      _originals[name] = current
      setattr(multihost_utils, name, replacement)
