"""`jdist train`'s two checkpoint tiers: persistent (--checkpoint-dir) and local.

The persistent tier is `jdist.CheckpointManager` on a filesystem every
process reads, written every --checkpoint-every steps and at epoch ends. The
local tier (`--local-checkpoint-every K`) is a cheap, frequent save to a
per-node directory (default under /dev/shm, else the system's temp dir), so
that a restart loses at most K steps instead of --checkpoint-every:

  * `LocalManager` saves like `jdist.CheckpointManager` (rank 0 writes, the
    same record and per-replica layout, the same checks) but into plain
    numpy files, synchronously: into `<step>.partial-<pid>`, renamed to
    `<step>` once complete. A save cut short leaves only the partial
    directory, which is never listed, so it is never read; older steps are
    deleted only after a newer one is complete, so the last good one is
    never written over. orbax was measured for this tier and did not fit
    the budget (docs/reliability.md, "Local checkpoints"): its
    `AsyncCheckpointer` took 8-110 ms in the training thread and 60-200 ms
    more in the background per save on the 2-core test machine, against
    about 45 ms for 3% of 50 CNN steps; its emergency (multi-tier) manager
    needs `jax.distributed` and a global mesh over slices, while jdist's
    processes talk through MPI and only host arrays reach orbax on rank 0.
  * `usable_local_steps`: a local step can be resumed from only if every
    process has it, identically (the same record): each process reads its
    own node's copy. A new host whose local directory is empty (or holds
    another copy) makes the resume fall back to the persistent tier.
  * `resume_order`: the candidates of both tiers, newest first; the run
    takes the first that restores (`jdist.app.train_loop.Run.open_checkpoints`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
from typing import Callable

import jax.numpy as jnp
import numpy as np

import jdist
from jdist.checkpoint import layout
from jdist import errors
from jdist.runtime import host

PERSISTENT = "persistent"
LOCAL = "local"
LOCAL_KEEP = 2  # local steps kept: the newest and one before it, should the newest be damaged
_ARRAYS_FILE, _RECORD_FILE = "arrays.npz", "record.json"


def default_local_dir(checkpoint_dir: str) -> str:
  """A per-node directory for the local tier of the run that writes `checkpoint_dir`.

  Under /dev/shm (memory) where it can be written, else the system temp dir;
  named by this host's name and a digest of the persistent directory's path,
  so that runs and nodes sharing a filesystem do not mix.
  """
  base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
      else tempfile.gettempdir()
  digest = hashlib.sha1(os.path.abspath(checkpoint_dir).encode()).hexdigest()[:12]
  return os.path.join(base, "jdist-local", f"{socket.gethostname()}-{digest}")


class LocalManager(jdist.CheckpointManager):
  """A `jdist.CheckpointManager` whose rank 0 writes plain numpy files to a local disk.

  Every method is collective, as the base class's; the checks, the record
  and the per-replica layout are the base class's too. Only the files
  differ: `<step>/record.json` and `<step>/arrays.npz` (uncompressed; zip's
  CRC-32 catches damaged members on read), written into a temporary
  `<step>.partial-<pid>` directory renamed to `<step>` once complete.

  Args:
    directory: this node's local directory.
    keep: newest complete local checkpoints to keep.
  """

  def __init__(self, directory: str, *, keep: int = LOCAL_KEEP):
    super().__init__(directory, keep=keep)

  def _local_steps(self) -> list[int]:
    # Complete steps only: a `<step>.partial-*` or `<step>.corrupt` is never listed.
    if not self.directory.exists():
      return []
    return sorted(int(name) for name in os.listdir(self.directory) if name.isdigit()
                  and os.path.exists(os.path.join(self.directory, name, _RECORD_FILE)))

  def _write(self, step: int, arrays: dict, record: dict) -> None:
    directory = os.fspath(self.directory)
    os.makedirs(directory, exist_ok=True)
    partial = os.path.join(directory, f"{step}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    # Bytes, so that dtypes numpy's format does not know (bfloat16) come back as
    # they were: the record has each leaf's dtype and shape.
    np.savez(os.path.join(partial, _ARRAYS_FILE),
             **{name: np.ascontiguousarray(x).reshape(-1).view(np.uint8)
                for name, x in arrays.items()})
    with open(os.path.join(partial, _RECORD_FILE), "w", encoding="utf-8") as stream:
      json.dump(record, stream)
    os.rename(partial, os.path.join(directory, str(step)))
    # Older steps go only now that a newer one is complete.
    steps = self._local_steps()
    for old in steps[:-self.keep] if self.keep else []:
      shutil.rmtree(os.path.join(directory, str(old)), ignore_errors=True)
    for name in os.listdir(directory):  # a killed writer's (only rank 0 writes, one at a time)
      if ".partial-" in name:
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)

  def _read_record(self, step: int) -> dict:
    path = os.path.join(os.fspath(self.directory), str(step))
    try:
      with open(os.path.join(path, _RECORD_FILE), encoding="utf-8") as stream:
        record = json.load(stream)
    except (OSError, ValueError) as err:
      raise errors.CheckpointCorruptError(
          f"{path} is not a readable jdist checkpoint ({type(err).__name__}: {err}).") from err
    layout.check_format(path, record)
    return record

  def _read_local(self, path, record: dict, style: str) -> list[np.ndarray]:
    _, saved_replicas = layout.saved_copies(record)
    arrays = {}
    try:
      with np.load(os.path.join(os.fspath(path), _ARRAYS_FILE)) as stored:
        for i, leaf in enumerate(record["leaves"]):
          name = layout.leaf_name(i)
          shape = ((saved_replicas if leaf["per_replica"] else 1,)
                   + tuple(leaf["stored_shape"]))
          if int(np.prod(shape, dtype=np.int64)) > 0:
            arrays[name] = stored[name].view(jnp.dtype(leaf["stored_dtype"])).reshape(shape)
    except Exception as err:  # pylint: disable=broad-except
      raise errors.CheckpointCorruptError(
          f"{path} could not be read: its files are damaged, truncated or partly deleted "
          f"({type(err).__name__}: {err}).") from err
    return layout.local_copies(path, record, arrays, self.topology, style)

  def drop_after(self, step: int | None) -> list[int]:
    """Deletes rank 0's local steps newer than `step` (None: all); returns them.

    After a resume from an older step (the persistent tier, or an older local
    one) they belong to a future the run will not have, and steps must grow.
    """
    def drop():
      newer = [s for s in self._local_steps() if step is None or s > step]
      for stale in newer:
        shutil.rmtree(os.path.join(os.fspath(self.directory), str(stale)))
      return newer
    return self._from_rank0(drop, "jdist train: local checkpoints")


def _record_digest(manager: LocalManager, step: int) -> str | None:
  try:
    record = manager._read_record(step)  # pylint: disable=protected-access
  except errors.CheckpointError:
    return None  # unreadable here: not usable (the others may have it)
  return hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()


def usable_local_steps(manager: LocalManager) -> list[int]:
  """Local steps every process holds identically (collective), oldest first.

  Each process lists its own node's complete steps and a digest of each
  one's record; a step counts only where every process has the same one.
  """
  mine = {}
  if manager.directory.exists():
    for step in manager._local_steps()[-manager.keep:]:  # pylint: disable=protected-access
      digest = _record_digest(manager, step)
      if digest is not None:
        mine[step] = digest
  everyone = host.allgather_object(mine, "jdist train: local checkpoint steps")
  return sorted(step for step, digest in everyone[0].items()
                if all(other.get(step) == digest for other in everyone[1:]))


def resume_order(persistent: list[int], local: list[int]) -> list[tuple[int, str]]:
  """(step, tier) candidates, newest first; at equal steps the persistent one first.

  Args:
    persistent: the persistent tier's complete steps.
    local: the local steps every process holds (`usable_local_steps`).
  """
  candidates = [(step, PERSISTENT) for step in persistent] + [(step, LOCAL) for step in local]
  return sorted(candidates, key=lambda c: (c[0], c[1] == PERSISTENT), reverse=True)


def resume_newest(candidates: list[tuple[int, str]], managers: dict, resume: Callable,
                  say: Callable[[str], None]) -> int | None:
  """Resumes from the first readable candidate; returns its step (None: none was).

  A candidate that cannot be read (`errors.CheckpointCorruptError`) is set
  aside (`<step>.corrupt`), said, and the next one tried.

  Args:
    candidates: `resume_order`'s (step, tier) pairs, newest first.
    managers: the manager of each tier (`PERSISTENT`, `LOCAL`).
    resume: `resume(step, manager)` restores the run from that checkpoint.
    say: prints a warning line for the user.
  """
  def named(tier: str, step: int) -> str:
    return f"{'local ' if tier == LOCAL else ''}checkpoint step {step}"

  for index, (step, tier) in enumerate(candidates):
    manager = managers[tier]
    try:
      resume(step, manager)
    except errors.CheckpointCorruptError as err:
      moved = manager.set_aside(step)
      following = candidates[index + 1:]
      say(f"warning: {named(tier, step)} cannot be read ({err}); moved it to {moved}"
          + (f"; trying {named(following[0][1], following[0][0])}" if following else ""))
      continue
    return step
  return None

