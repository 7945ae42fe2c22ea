"""Are the replicas still identical? A host-side check of replicated state.

Plain data parallelism keeps every replica's parameters bit-for-bit equal:
each replica applies the same averaged update. A bug, a non-deterministic
op, a rank that skipped a step or a flipped bit breaks that silently, and
the replicas drift apart. `check_replicas` finds it: every process hashes
each leaf of each of its local replicas (the exact bytes), the small digests
cross processes with one all-gather, and every process gets the same list of
leaves whose replicas differ from global replica 0.

Call it on every process (it is collective), e.g. every few hundred steps or
before a checkpoint. It copies the state to the host, so it costs about one
host transfer of the state. Under `jdist.partial_sync` and with error
feedback residuals (`jdist.topk`, `jdist.threshold`) some optimizer state
legitimately differs per replica: check the parameters, not that state.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

from jdist.data import batches
from jdist import errors
from jdist.runtime import job as job_lib
from jdist.runtime import host

_SHOWN = 10  # mismatches an error message lists before "... and N more"


class ReplicaMismatchError(errors.JdistError):
  """Replicas that should be identical hold different values."""


@dataclasses.dataclass(frozen=True)
class ReplicaMismatch:
  """One leaf whose replicas differ from global replica 0.

  Attributes:
    path: the leaf's key path (`jax.tree_util.keystr`), e.g. "['Dense_0']['kernel']".
    replicas: global replica indices whose bytes differ from replica 0's.
    sums: every replica's sum of the leaf (float64), in global replica
      order: a readable hint of how far apart they are.
  """
  path: str
  replicas: tuple[int, ...]
  sums: tuple[float, ...]

  def __str__(self) -> str:
    shown = ", ".join(f"replica {r} sum {self.sums[r]:.9g}" for r in self.replicas)
    return f"{self.path}: differs from replica 0 (sum {self.sums[0]:.9g}) on {shown}"


def _plain(leaf: Any) -> Any:
  """PRNG key arrays as their raw key data; anything else as an array."""
  if isinstance(leaf, jax.Array):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return jax.random.key_data(leaf)
    return leaf
  return np.asarray(leaf)


def _local_copies(leaf: Any, devices: int, path: str) -> list[np.ndarray]:
  """This process's replicas of one leaf, in local device order, on the host."""
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    # Backend "jax": a global array; this process holds its own replicas' rows.
    shards = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
    rows = np.concatenate([np.asarray(s.data) for s in shards])
  else:
    rows = np.asarray(leaf)
  problem = batches.leading_axis_error(
      f"jdist.consistency.check_replicas: leaf {path}", rows.shape, devices,
      f"replicated state has a leading axis of one copy per local device ({devices}). "
      f"Pass the replicated tree (from jdist.replicate or a jdist.data_parallel step), "
      f"not an unreplicated one.")
  if problem is not None:
    raise problem
  return [np.ascontiguousarray(rows[i]) for i in range(devices)]


def _fingerprint(copy: np.ndarray) -> tuple[str, float]:
  """(digest of the exact bytes, float64 sum) of one replica's leaf."""
  digest = hashlib.blake2b(copy.tobytes(), digest_size=16).hexdigest()
  try:
    total = float(np.sum(copy, dtype=np.float64))
  except (TypeError, ValueError):
    total = float("nan")  # e.g. bool or structured data: the digest decides
  return digest, total


def check_replicas(tree: Any, *, raise_on_mismatch: bool = False) -> list[ReplicaMismatch]:
  """Lists the leaves whose replicas are not bit-for-bit equal to replica 0.

  Collective: call it on every process with the same tree structure.

  Args:
    tree: replicated state, every leaf with a leading axis of one copy per
      local device (as made by `jdist.replicate` or returned by a
      `jdist.data_parallel` step).
    raise_on_mismatch: raise `ReplicaMismatchError` (on every process)
      instead of returning a non-empty list.

  Returns:
    One `ReplicaMismatch` per differing leaf, in leaf order, the same list on
    every process; empty when every replica equals replica 0.

  Raises:
    ReplicaMismatchError: with `raise_on_mismatch=True`, if any leaf differs.
    jdist.errors.ShapeError: a leaf lacks the leading device axis.
    jdist.errors.StructureMismatchError: processes passed different trees.
  """
  devices = job_lib.current().local_device_count
  plain = jax.tree.map(_plain, tree)
  # First, so that a tree that differs on one process fails on every process.
  job_lib.check_structure(plain, "jdist.consistency.check_replicas")
  with_paths = jax.tree_util.tree_leaves_with_path(plain)
  paths = [jax.tree_util.keystr(path) for path, _ in with_paths]
  copies = [_local_copies(leaf, devices, path) for path, (_, leaf) in zip(paths, with_paths)]
  mine = [[_fingerprint(c) for c in leaf_copies] for leaf_copies in copies]
  everyone = host.allgather_object(mine, "jdist.consistency.check_replicas")

  mismatches = []
  for index, path in enumerate(paths):
    per_replica = [fp for process in everyone for fp in process[index]]  # global order
    reference = per_replica[0][0]
    differing = tuple(r for r, (digest, _) in enumerate(per_replica) if digest != reference)
    if differing:
      mismatches.append(ReplicaMismatch(path, differing, tuple(s for _, s in per_replica)))
  if mismatches and raise_on_mismatch:
    raise ReplicaMismatchError(describe_mismatches(mismatches, len(paths)))
  return mismatches


def describe_mismatches(mismatches: list[ReplicaMismatch], leaves: int) -> str:
  """The error message for `mismatches` among `leaves` checked leaves."""
  lines = [f"Replicas diverged: {len(mismatches)} of {leaves} leaves differ from global "
           f"replica 0."]
  lines += [f"  {m}" for m in mismatches[:_SHOWN]]
  if len(mismatches) > _SHOWN:
    lines.append(f"  ... and {len(mismatches) - _SHOWN} more")
  lines.append("Replicas of plain data-parallel training must stay identical: look for a "
               "step that ran on some replicas only, a transformation that is not "
               "reduced over replicas, or non-deterministic host input. Re-synchronize "
               "with jdist.sync_params (averages) or broadcast rank 0's values.")
  return "\n".join(lines)
