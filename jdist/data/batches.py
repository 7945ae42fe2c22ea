"""Host batches cut for the replicas: this process's part of a global batch, per device.

A data-parallel step takes, on each process, an array shaped
`[local_device_count, per_replica_batch, ...]`. Two ways lead there:

- `jdist.ShardedLoader` reads each replica's own examples (its
  `batch_size` is per replica: the global batch is `batch_size x
  replica_count`, and each process yields `local_device_count x
  batch_size` examples per step);
- an existing pipeline that yields the whole *global* batch on every
  process: `jdist.shard(jdist.process_slice(global_batch))` keeps this
  process's rows and splits them over its devices. Feeding the whole global
  batch to every process instead trains the same model while every process
  repeats every other's work.

Replicas are numbered process-major (`jdist.Topology`), and replica `r`
gets rows `[r * B, (r + 1) * B)` of the global batch, so N replicas on
batches of B compute what one device computes on the N*B batch.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jdist import errors
from jdist.collectives import context
from jdist.runtime import host
from jdist.runtime import job as job_lib

_AGREED_LIMIT = 64  # global batch signatures every process is known to have passed
_agreed: set = set()
_last_agreed: list[str] = []  # the last batch every process passed, described


def _leading_size(batch: Any, what: str) -> int:
  sizes = {np.shape(leaf)[:1] for leaf in jax.tree.leaves(batch)}
  if len(sizes) != 1 or sizes == {()}:
    raise errors.ShapeError(f"{what}: leaves have leading sizes {sorted(sizes)}; "
                            f"every leaf needs the same leading batch dimension.")
  (size,), = sizes
  return size


def leading_axis_error(what: str, shape: tuple[int, ...], devices: int,
                       advice: str) -> errors.ShapeError | None:
  """The error for a leaf that lacks the leading axis of one row per local device.

  Args:
    what: the caller and leaf, e.g. "jdist.checkpoint: leaf ['w']".
    shape: the leaf's shape.
    devices: the local device count the leading axis must equal.
    advice: what the user should pass instead.

  Returns:
    None when `shape` leads with `devices`, else a ShapeError naming both.
  """
  if shape and shape[0] == devices:
    return None
  got = "a scalar" if not shape else f"leading size {shape[0]}"
  return errors.ShapeError(f"{what} has {got}, but {advice}")


def _not_divisible(what: str, size: int, parts: int, unit: str) -> errors.ShapeError:
  lower = (size // parts) * parts
  suggestion = f"{lower} or {lower + parts}" if lower else parts
  return errors.ShapeError(
      f"{what}: batch leading size {size} is not divisible by {parts} {unit}; use a "
      f"batch size that is a multiple of {parts}, e.g. {suggestion}.")


def shard_batch(batch: Any, local_device_count: int | None = None) -> Any:
  """Splits a host batch of leading size N into `[local_device_count, N // local_device_count, ...]`.

  Args:
    batch: a pytree of arrays that share the leading size N.
    local_device_count: number of local devices; default
      `jax.local_device_count()`.

  Returns:
    The same pytree with every leaf reshaped (a view when possible).

  Raises:
    jdist.errors.ShapeError: N is not divisible by `local_device_count`, or
      the leaves disagree on N.
    ValueError: `local_device_count` is not a positive integer.
  """
  if local_device_count is None:
    local_device_count = jax.local_device_count()
  if (isinstance(local_device_count, bool)
      or not isinstance(local_device_count, (int, np.integer)) or local_device_count < 1):
    raise ValueError(f"local_device_count={local_device_count!r} must be an integer >= 1.")
  size = _leading_size(batch, "shard_batch")
  if size % local_device_count:
    raise _not_divisible("shard_batch", size, local_device_count, "local devices")
  return jax.tree.map(
      lambda leaf: np.reshape(leaf, (local_device_count, -1) + np.shape(leaf)[1:]), batch)


def process_slice(global_batch: Any, topology=None) -> Any:
  """This process's rows of a global batch that every process holds whole.

  Args:
    global_batch: a pytree of host arrays sharing the leading size G, the
      global batch (the same on every process).
    topology: the job's `jdist.Topology`; default `jdist.init()`'s.

  Returns:
    The rows `[p * G / P, (p + 1) * G / P)` of every leaf for process p of P
    (a view): pass them to `jdist.shard` for the per-device split.

  Raises:
    jdist.errors.ShapeError: G is not divisible by the replica count, or the
      leaves disagree on G.
  """
  if topology is None:
    topology = job_lib.current()
  size = _leading_size(global_batch, "process_slice")
  if size % topology.replica_count:
    raise _not_divisible("process_slice", size, topology.replica_count,
                         f"replicas ({topology.process_count} processes x "
                         f"{topology.local_device_count} devices)")
  rows = size // topology.process_count
  start = topology.process_index * rows
  return jax.tree.map(lambda leaf: leaf[start:start + rows], global_batch)


def shard_global_batch(global_batch: Any, topology=None) -> Any:
  """This process's rows of a global batch, sharded over `jdist.mesh()`: for jit steps.

  The jit-with-sharding counterpart of `jdist.shard(jdist.process_slice(...))`:
  leaves come back without a device axis, as arrays sharded over the data
  axis of `jdist.mesh()` (with the "jax" backend, one global array over
  every process's devices).

  Args:
    global_batch: a pytree of host arrays sharing the leading size G, the
      same on every process.
    topology: the job's `jdist.Topology`; default `jdist.init()`'s.

  Returns:
    The pytree of sharded `jax.Array`s.

  Processes must pass global batches of one size and structure: each new
  one (the first, a last smaller batch) is compared across processes once, a
  host exchange under the watchdog's deadline; a batch seen before costs no
  exchange.

  Raises:
    jdist.errors.ShapeError: as `process_slice`; or, on every process, the
      processes passed global batches of different sizes or structures
      (naming each rank's).
  """
  if topology is None:
    topology = job_lib.current()
  if topology.process_count > 1:
    check_same_batch(global_batch, "jdist.shard_global_batch")
  return place_process_rows(process_slice(global_batch, topology), topology)


def _describe_batch(leaves: tuple, paths: list) -> str:
  """'48 rows (['x'] float32[48, 8, 8, 1], ['y'] int32[48])'."""
  shapes = ", ".join(f"{jax.tree_util.keystr(path)} {dtype.name}{list(shape)}"
                     for path, (shape, dtype) in zip(paths, leaves))
  rows = leaves[0][0][0] if leaves and leaves[0][0] else "?"
  return f"{rows} rows ({shapes})"


def check_same_batch(global_batch: Any, what: str) -> None:
  """Raises on every process unless all passed a global batch of one signature.

  Collective the first time each process sees a signature (leaves' shapes
  and dtypes, and the tree's structure); free for one it has seen agreed.
  A process whose batch alone changes waits in the exchange, which the
  watchdog ends at its deadline with a report naming it and its batch.

  Raises:
    jdist.errors.ShapeError: naming every rank's batch size and leaves.
  """
  leaves, treedef = jax.tree.flatten(global_batch)
  signature = (treedef, tuple((np.shape(leaf), np.dtype(getattr(leaf, "dtype", None)
                                                       or np.asarray(leaf).dtype))
                              for leaf in leaves))
  if signature in _agreed or not host.is_multiprocess():
    return
  paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(global_batch)]
  mine = _describe_batch(signature[1], paths)
  rank = job_lib.current().process_index
  before = f", after {_last_agreed[0]} until now" if _last_agreed else ""
  every = host.allgather_object(
      (repr(signature), mine),
      f"{what}: comparing global batches across processes (rank {rank} passes {mine}{before})")
  if len({key for key, _ in every}) == 1:
    if len(_agreed) >= _AGREED_LIMIT:
      _agreed.clear()
    _agreed.add(signature)
    _last_agreed[:] = [mine]
    return
  groups: dict[str, list[int]] = {}
  for other, (_, described) in enumerate(every):
    groups.setdefault(described, []).append(other)
  parts = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
                    f"{described}" for described, ranks in groups.items())
  raise errors.ShapeError(
      f"{what}: the processes passed different global batches: {parts}. Every process "
      f"must pass the same whole global batch (the same size and structure) at each step; "
      f"{what} keeps each process's own rows of it. Feed every process the same global "
      f"batches (the same batch size and order), or a per-process loader's rows through "
      f"jdist.data.batches.place_process_rows.")


def place_process_rows(rows: Any, topology) -> Any:
  """This process's rows of a global batch, placed over the data axis of `jdist.mesh()`.

  Args:
    rows: a pytree of host arrays, this process's part of the global batch
      (from `process_slice`, or a loader that reads only this process's rows).
    topology: the job's `jdist.Topology`.

  Returns:
    The pytree of sharded `jax.Array`s: one global array over every
    process's devices with the "jax" backend, else over the local devices.
  """
  sharding = NamedSharding(context.mesh(), PartitionSpec(context.DATA_AXIS))
  if topology.backend == "jax":
    return jax.tree.map(
        lambda leaf: jax.make_array_from_process_local_data(sharding, np.asarray(leaf)), rows)
  return jax.device_put(rows, sharding)
