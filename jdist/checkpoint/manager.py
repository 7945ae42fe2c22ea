"""Checkpoints of training state in either step style, written by rank 0 with orbax.

A state comes in one of two styles (`jdist.checkpoint.layout`): *replicated*
(the data_parallel style: a leading axis of one copy per local device, as
`jdist.replicate` lays it out) or *global* (the jit style: arrays over
`jdist.mesh()`, one copy per process, e.g. `nnx.state(model)`). The copies
are not always equal: the error-feedback residuals of `jdist.topk` and the
parameters under `jdist.partial_sync` differ per copy. A checkpoint keeps
every copy, so resuming is exact:

  * `save` compares the copies (bytes on each process, a digest across
    processes). A leaf equal on every copy is stored once, with a leading
    axis of 1; the others are gathered to rank 0 and stored with a leading
    [copies] axis, in global replica (or process) order. Only host arrays
    reach orbax, so arrays over one process's devices are no problem.
  * Rank 0 writes with orbax's synchronous `Checkpointer`: into
    `<directory>/<step>.orbax-checkpoint-tmp`, renamed to `<directory>/<step>`
    once complete. A writer killed midway leaves only the temporary
    directory, which `latest_step` and `restore` ignore and the next save of
    that step replaces. The other processes wait for rank 0's outcome, so
    nobody runs ahead and a failed write raises on every rank.
  * `restore` runs on every process, each reading the files itself (the
    directory must be on a filesystem every process sees) and taking its own
    copies (`Topology.replica_indices`, or its process index).

A JSON record in the same step directory holds the world and style it was
written by, a fingerprint of the state (paths, per-copy shapes, dtypes) and
the user's metadata. A checkpoint restores into another style or number of
copies only when every leaf was equal on every copy (plain `jdist.dist_opt`).

Every method is collective: call it on every process, in the same order.
Only rank 0 calls orbax to write, telling orbax that it is a world of its
own (`active_processes={this process}`), so orbax adds no barriers of its
own. The other ranks wait for rank 0 under jdist's watchdog deadline: raise
`jdist.init(timeout=...)` if writing a checkpoint can take longer.
"""

from __future__ import annotations

import logging
import operator
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jdist.checkpoint import layout
from jdist import errors
from jdist.data import grain as grain_data
from jdist.collectives import routes
from jdist.runtime import topology as topology_lib
from jdist.runtime import host
from jdist.runtime import job as job_lib
# Re-exported: the record's format and `fingerprint` are part of this module's API.
from jdist.checkpoint.layout import (  # pylint: disable=unused-import
    FORMAT, FORMAT_VERSION, fingerprint)

log = logging.getLogger(__name__)

_ARRAYS = "state"      # orbax item: the stored arrays
_RECORD = "jdist"      # orbax item: the JSON record


def _first_line(err: Exception) -> str:
  """`Kind: first line of the message` (tensorstore's run to many lines)."""
  return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}"


class CheckpointManager:
  """Saves and restores replicated training state; rank 0 writes, everyone reads.

  Every method is collective: call it on every process, in the same order.
  The directory must be on a filesystem every process can read.

  Example:
    ```python
    manager = jdist.CheckpointManager("/shared/run1/ckpt", keep=3)
    state = {"params": params, "opt_state": opt_state}   # replicated
    if manager.latest_step() is not None:
      state, meta = manager.restore(state)
      start = meta["step"] + 1
    ...
    manager.save(step, state, metadata={"step": step, "epoch": epoch})
    ```

  Args:
    directory: where step directories `<directory>/<step>` are kept.
    keep: newest checkpoints to keep (older ones are deleted after a save);
      None keeps all.
    topology: the job's topology; default `jdist.init()`.

  Raises:
    ValueError: a bad `keep`, or a topology that is not this process's.
  """

  def __init__(self, directory: Any, *, keep: int | None = 3,
               topology: topology_lib.Topology | None = None):
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
      raise ValueError(f"keep={keep!r} must be an int >= 1 (checkpoints to keep) or None "
                       f"(keep all).")
    # orbax refuses relative paths; every rank resolves from its own cwd.
    self.directory = epath.Path(os.path.abspath(os.fspath(directory))) if isinstance(
        directory, (str, os.PathLike)) else epath.Path(directory)
    self.keep = keep
    self.topology = topology or routes.init()
    real = routes.init()
    if (self.topology.process_count, self.topology.process_index) != (
        real.process_count, real.process_index) or (
            self.topology.local_device_count > jax.local_device_count()):
      raise ValueError(f"topology={self.topology} does not describe this process "
                       f"({real}); leave topology=None to use jdist.init()'s.")
    # This process is its own orbax world (see the module doc).
    me = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                            active_processes={jax.process_index()})
    self._checkpointer = ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            composite_options=ocp.CompositeOptions(multiprocessing_options=me),
            **{_ARRAYS: ocp.PyTreeCheckpointHandler(multiprocessing_options=me),
               _RECORD: ocp.JsonCheckpointHandler(multiprocessing_options=me)}),
        multiprocessing_options=me)

  def __repr__(self) -> str:
    return f"jdist.CheckpointManager({str(self.directory)!r}, keep={self.keep})"

  # Steps ------------------------------------------------------------------

  def _local_steps(self) -> list[int]:
    return sorted(ocp.path.step.checkpoint_steps(self.directory))

  def _from_rank0(self, compute, label: str):
    """Rank 0's result of `compute()` on every process; its error raised everywhere."""
    result, error, kind = None, None, errors.CheckpointError
    if self.topology.is_primary:
      try:
        result = compute()
      except errors.CheckpointError as err:
        error, kind = str(err), type(err)
      except Exception as err:  # pylint: disable=broad-except
        error = f"{self.directory}: {type(err).__name__}: {err}"
    problem = None if error is None else (error, kind)
    return host.agree(problem, label, lambda rank, problems: problems[rank][1](problems[rank][0]),
                      payload=result)[0]

  def all_steps(self) -> list[int]:
    """Steps of complete checkpoints, oldest first (as rank 0 sees them)."""
    return self._from_rank0(self._local_steps, "jdist checkpoint: list steps")

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None if there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _resolve_step(self, step: int | None) -> int:
    if not self.directory.exists():
      raise errors.CheckpointError(f"No checkpoint directory at {self.directory}.")
    steps = self._local_steps()
    if step is None:
      if not steps:
        raise errors.CheckpointError(
            f"No complete checkpoint in {self.directory} (unfinished "
            f"*.orbax-checkpoint-tmp directories of killed writers are ignored).")
      return steps[-1]
    if step not in steps:
      raise errors.CheckpointError(
          f"No complete checkpoint of step {step} in {self.directory}; complete steps: "
          f"{steps}.")
    return step

  def _read_record(self, step: int) -> dict:
    path = self.directory / str(step)
    try:
      record = self._checkpointer.restore(
          path, args=ocp.args.Composite(**{_RECORD: ocp.args.JsonRestore()}))[_RECORD]
    except Exception as err:  # pylint: disable=broad-except
      raise errors.CheckpointCorruptError(
          f"{path} is not a readable jdist checkpoint ({_first_line(err)}).") from err
    layout.check_format(path, record)
    return record

  def read_metadata(self, step: int | None = None) -> dict:
    """The stored record of a checkpoint (default: the latest), without its arrays.

    Returns:
      A dict with "step", "replica_count", "process_count",
      "local_device_count", "fingerprint", "leaves" and "user" (the metadata
      passed to `save`).

    Raises:
      jdist.errors.CheckpointError: no such checkpoint, or it is unreadable.
    """
    return self._from_rank0(lambda: self._read_record(self._resolve_step(step)),
                            "jdist checkpoint: read metadata")

  # Save -------------------------------------------------------------------

  def _check_new_step(self, step: int) -> None:
    steps = self._local_steps()
    if steps and step <= steps[-1]:
      raise errors.CheckpointError(
          f"Cannot save step {step} in {self.directory}: it already holds step "
          f"{steps[-1]}{' (this very step)' if step in steps else ''}. Steps must grow; "
          f"to restart from an older step, save into a new directory or delete the "
          f"newer step directories first.")

  def save(self, step: int, state: Any, *, metadata: dict | None = None,
           style: str | None = None, data_iterator: Any = None) -> None:
    """Writes a checkpoint of `state` as step `step`.

    Every replica's (or process's) copy is kept (see the module doc). Rank 0
    writes; every process returns once the checkpoint is complete (or raises).

    Args:
      step: the step number; must be larger than every saved step.
      state: a pytree of either style: replicated arrays of the data_parallel
        style (leading local-device axis), e.g. {"params": params,
        "opt_state": opt_state}; or global arrays of the jit style (over
        `jdist.mesh()`), e.g. {"model": nnx.state(model), "optimizer":
        nnx.state(optimizer)}.
      metadata: a JSON-serializable dict stored alongside (step, epoch,
        batch in epoch, seed, model name, config...). Rank 0's is written.
      style: "replicated" or "global"; None tells them apart by the leaves'
        placement (`jdist.checkpoint.layout.detect_style`).
      data_iterator: a data iterator (jdist.GrainLoader's); every process's position is kept.

    Raises:
      jdist.errors.ShapeError: a leaf does not fit the style (the message
        names the style it expected).
      jdist.errors.StructureMismatchError: processes hold different states.
      jdist.errors.CheckpointError: bad step or metadata, or the write failed.
    """
    try:
      step = operator.index(step)
    except TypeError:
      raise ValueError(f"step={step!r} must be an int.") from None
    if step < 0:
      raise ValueError(f"step={step} must be >= 0.")
    topo = self.topology
    style = layout.detect_style(state, topo.local_device_count, "CheckpointManager.save", style)
    leaves, signature = layout.state_signature(state, topo.local_device_count,
                                               "CheckpointManager.save", style)
    if not leaves:
      raise ValueError("CheckpointManager.save: the state has no arrays to save.")
    key_impls, host_leaves = layout.host_copies(leaves, style)
    job_lib.check_structure(jax.tree.unflatten(jax.tree.structure(state), host_leaves),
                            "jdist.CheckpointManager.save")
    user, problem = layout.encode_metadata(metadata)
    if problem is None and topo.is_primary:
      try:
        self._check_new_step(step)
      except errors.CheckpointError as err:
        problem = str(err)
    summaries = [layout.local_summary(x, digest=topo.multi_process) for x in host_leaves]
    everyone, positions = zip(*host.agree(
        problem, "jdist checkpoint: save check", lambda rank, problems: errors.CheckpointError(
            f"Checkpoint step {step} not saved (rank {rank}): {problems[rank]}"),
        payload=(summaries, grain_data.encode_position(data_iterator))))
    # Stored once if equal on every replica of every process, else per replica.
    per_replica = [None in column or len(set(column)) > 1 for column in zip(*everyone)]
    gathered = layout.gather_to_rank0(
        host_leaves, [i for i, p in enumerate(per_replica) if p], topo)

    failure = None
    if topo.is_primary:
      record = dict(layout.build_record(step, topo, signature, per_replica, key_impls,
                                        host_leaves, user, style), data_iterators=list(positions))
      # orbax cannot store zero-size arrays; the record alone describes them.
      arrays = {layout.leaf_name(i): gathered[i] if per_replica[i] else x[:1]
                for i, x in enumerate(host_leaves) if x.size}
      try:
        self._write(step, arrays, record)
      except Exception as err:  # pylint: disable=broad-except
        failure = f"{type(err).__name__}: {err}"
    # Doubles as the barrier after the write: nobody runs ahead of rank 0.
    host.agree(failure, "jdist checkpoint: rank 0 writes", lambda rank, failures: (
        errors.CheckpointError(f"Rank 0 could not write checkpoint step {step} to "
                               f"{self.directory}: {failures[rank]}")))

  def _write(self, step: int, arrays: dict, record: dict) -> None:
    self.directory.mkdir(parents=True, exist_ok=True)
    items = {_RECORD: ocp.args.JsonSave(record)}
    if arrays:
      items[_ARRAYS] = ocp.args.PyTreeSave(arrays)
    self._checkpointer.save(self.directory / str(step), args=ocp.args.Composite(**items))
    steps = self._local_steps()
    for old in steps[:-self.keep] if self.keep else []:
      (self.directory / str(old)).rmtree()
    # Only rank 0 writes, one save at a time: any temporary directory left is
    # a killed writer's, never one being written.
    for leftover in self.directory.glob(f"*{ocp.path.atomicity.TMP_DIR_SUFFIX}*"):
      log.info("Removing unfinished checkpoint %s (a writer was interrupted).", leftover)
      leftover.rmtree()

  # Restore ----------------------------------------------------------------

  def restore(self, state_template: Any, step: int | None = None, *,
              style: str | None = None, data_iterator: Any = None) -> tuple[Any, dict]:
    """Reads a checkpoint (default: the latest) into the template's style.

    Args:
      state_template: a pytree like the saved state, in this run's layout
        (arrays or `jax.ShapeDtypeStruct`s, e.g. the freshly initialized
        state): replicated (data_parallel style) or global (jit style, e.g.
        `nnx.state(model)`); only its structure, shapes, dtypes and, for
        global arrays, shardings are used.
      step: which checkpoint; default the latest complete one.
      style: "replicated" or "global"; None tells them apart as `save` does.
      data_iterator: the data iterator to move to this process's position saved with it.

    Returns:
      (state, metadata): in the replicated style, every local replica's own
      copy laid out as `jdist.replicate` lays it out; in the global style,
      this process's copy placed with the template's shardings (replicated
      over `jdist.mesh()` where the template has none); and the metadata
      given to `save`. A checkpoint whose leaves were equal on every copy
      restores into either style and any number of replicas.

    Raises:
      jdist.errors.CheckpointError: no such checkpoint, a corrupt one, one of
        another model (naming the first differing leaf), or per-copy state
        written by another style or number of replicas (processes).
    """
    topo = self.topology
    style = layout.detect_style(state_template, topo.local_device_count,
                                "CheckpointManager.restore", style)
    templates, signature = layout.state_signature(state_template, topo.local_device_count,
                                                  "CheckpointManager.restore", style)
    wanted = step
    step = self._from_rank0(lambda: self._resolve_step(wanted), "jdist checkpoint: find step")
    path = self.directory / str(step)
    state, problem, corrupt = None, None, False
    try:
      record = self._read_record(step)
      layout.check_fingerprint(path, record, signature)
      layout.check_world(path, record, topo, style)
      grain_data.restore_position(data_iterator, record, path, topo)
      stacked = self._read_local(path, record, style)
      if style == layout.REPLICATED:
        devices = jax.local_devices()[:topo.local_device_count]
        state = [layout.put_local(x, devices, leaf["key_impl"])
                 for x, leaf in zip(stacked, record["leaves"])]
      else:
        state = [layout.put_global(x[0], template, leaf["key_impl"])
                 for x, template, leaf in zip(stacked, templates, record["leaves"])]
    except errors.CheckpointError as err:
      problem, corrupt = str(err), isinstance(err, errors.CheckpointCorruptError)
    except Exception as err:  # pylint: disable=broad-except
      problem, corrupt = (f"{path} could not be read: its files are damaged, truncated or "
                          f"partly deleted ({_first_line(err)})."), True
    def restore_error(rank: int, problems: list) -> errors.CheckpointError:
      kind = (errors.CheckpointCorruptError if any(p and p[1] for p in problems)
              else errors.CheckpointError)
      if problems[rank][0] == problem:
        return kind(problem)
      return kind(f"Rank {rank} could not restore: {problems[rank][0]} (the checkpoint "
                  f"directory must be on a filesystem every process reads).")

    host.agree(None if problem is None else (problem, corrupt), "jdist checkpoint: restore",
               restore_error)
    note = layout.restore_note(path, record, topo, style)
    if note and topo.is_primary:
      log.warning("%s", note)
    return jax.tree.unflatten(jax.tree.structure(state_template), state), record["user"]

  def set_aside(self, step: int) -> str:
    """Renames an unreadable checkpoint `<step>` to `<step>.corrupt` (rank 0).

    Steps only grow, so a run resumed from an older step could otherwise
    never save past the damaged one. The files stay for inspection.

    Returns:
      The new path.
    """
    def rename():
      source = self.directory / str(step)
      target = self.directory / f"{step}.corrupt"
      suffix = 1
      while target.exists():
        suffix += 1
        target = self.directory / f"{step}.corrupt{suffix}"
      source.rename(target)
      return str(target)
    return self._from_rank0(rename, "jdist checkpoint: set aside")

  def _read_local(self, path, record: dict, style: str) -> list[np.ndarray]:
    """This process's copies of every leaf (see `layout.local_copies`)."""
    _, saved_replicas = layout.saved_copies(record)
    names = {layout.leaf_name(i): leaf for i, leaf in enumerate(record["leaves"])
             if int(np.prod(leaf["stored_shape"], dtype=np.int64)) > 0}
    arrays = {}
    if names:
      target = {name: jax.ShapeDtypeStruct(
          (saved_replicas if leaf["per_replica"] else 1,) + tuple(leaf["stored_shape"]),
          jnp.dtype(leaf["stored_dtype"])) for name, leaf in names.items()}
      restore_args = {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in names}
      arrays = self._checkpointer.restore(path, args=ocp.args.Composite(**{
          _ARRAYS: ocp.args.PyTreeRestore(target, restore_args=restore_args)}))[_ARRAYS]
    return layout.local_copies(path, record, arrays, self.topology, style)
