"""Checkpoints of `jdist train --shrink`, for the losses a shrink cannot survive.

A shrink survives lost processes; a lost node ends the whole job (PRRTE 3.0,
`jdist.app.launch_shrink`), and `jdist launch --shrink --max-restarts N`
then starts it again on the healthy hosts. This module is what the new run
resumes from.

Every replica of a `--shrink` run holds the same state (the survivors'
parameters are bit-identical, checked after each shrink), so the live rank 0
writes it alone, with orbax, at states every member agreed on; nobody waits
for the write, so a writer that dies costs nothing but its checkpoint (orbax
writes into a temporary directory and renames it once complete). JAX's
distributed runtime is off in this mode: orbax sees one process everywhere.
A resumed run reads the step rank 0 names, on every process (the directory
must be on a filesystem every process sees), and keeps the checkpoint's
global batch, so the restarted job takes the same examples at every step
whatever its process count.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orbax.checkpoint as ocp


class ShrinkCheckpoints:
  """The checkpoints of one `--shrink` run in `directory`, every `every` steps.

  Args:
    directory: where the step directories go (created by the first save).
    every: save at the first agreed state at least this many steps after the
      last save (0: at epoch ends only), and at every epoch's end.
    keep: how many checkpoints to keep (the newest).
  """

  def __init__(self, directory: str, every: int = 0, keep: int = 3):
    self.directory = os.path.abspath(directory)
    self.every, self.keep = every, keep
    self.last_saved: int | None = None
    self._writer: ocp.CheckpointManager | None = None

  def _manager(self, read_only: bool) -> ocp.CheckpointManager:
    if read_only:  # the options a reader has (orbax warns about any other)
      options = ocp.CheckpointManagerOptions(read_only=True, save_interval_steps=0,
                                             create=False, enable_async_checkpointing=False)
    else:
      options = ocp.CheckpointManagerOptions(max_to_keep=self.keep,
                                             enable_async_checkpointing=False)
    absl = logging.getLogger("absl")  # a reader's manager warns that it is one
    level = absl.level
    absl.setLevel(logging.ERROR if read_only else level)
    try:
      return ocp.CheckpointManager(self.directory, options=options)
    finally:
      absl.setLevel(level)

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None."""
    if not os.path.isdir(self.directory):
      return None
    return self._manager(read_only=True).latest_step()

  def due(self, step: int, epoch_end: bool) -> bool:
    """Whether the agreed state after `step` steps is saved."""
    if step == self.last_saved:
      return False
    if epoch_end:
      return True
    since = step - (self.last_saved or 0)
    return bool(self.every) and since >= self.every

  def save(self, step: int, state: dict[str, Any], global_batch: int, primary: bool) -> None:
    """Writes `state` (arrays; the same on every member) as step `step` on the primary."""
    self.last_saved = step
    if not primary:
      return
    if self._writer is None:  # the first save here, or this process became rank 0
      self._writer = self._manager(read_only=False)
    self._writer.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        run=ocp.args.JsonSave({"global_batch": int(global_batch), "step": int(step)})))

  def global_batch(self, step: int) -> int:
    """The global batch of the run that wrote step `step`."""
    run = self._manager(read_only=True).restore(
        step, args=ocp.args.Composite(run=ocp.args.JsonRestore()))["run"]
    return int(run["global_batch"])

  def restore(self, step: int, template: dict[str, Any]) -> dict[str, Any]:
    """Step `step`'s state, shaped like `template` (read by this process itself)."""
    self.last_saved = step
    restored = self._manager(read_only=True).restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(template)))
    return dict(restored["state"])
