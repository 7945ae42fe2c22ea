"""Where a `jdist train` run stands, and its epoch's metrics so far.

Both go into each checkpoint's metadata (`jdist.app.train_loop.Run.save`),
so a resumed epoch reports the same totals as an uninterrupted one.
"""

from __future__ import annotations

import jax
import numpy as np

SUM_KEYS = ("loss_sum", "correct_sum", "weight_sum", "count")  # a step's metric sums


def fresh_position() -> dict:
  """Where a run stands, as stored in checkpoint metadata (see `Run.save`)."""
  return {"epoch": 0, "batch_in_epoch": 0, "step": 0, "history": [], "epoch_sums": None,
          "epoch_wire": 0.0, "epoch_train_time": 0.0, "epoch_nonfinite": 0,
          "epoch_skipped_before": None}


class EpochTally:
  """An epoch's training metrics so far (host sums), resumable from a checkpoint."""

  def __init__(self, position: dict):
    self.sums = dict(position["epoch_sums"] or {})
    self.carried_wire = position["epoch_wire"]
    self.carried_time = position["epoch_train_time"]
    self.nonfinite = position.get("epoch_nonfinite", 0)
    self.skipped_before = position.get("epoch_skipped_before")
    self.wires: list = []
    self.rolled_back = False

  def restart(self, skipped: int | None) -> None:
    """After a rollback: the epoch's metrics count only the steps from here on."""
    self.sums, self.carried_wire, self.carried_time, self.wires = {}, 0.0, 0.0, []
    self.nonfinite, self.skipped_before, self.rolled_back = 0, skipped, True

  def position(self, elapsed: float) -> dict:
    wire = self.carried_wire + sum(float(np.asarray(w)[0]) for w in jax.device_get(self.wires))
    return {"epoch_sums": dict(self.sums), "epoch_wire": wire,
            "epoch_train_time": self.carried_time + elapsed,
            "epoch_nonfinite": self.nonfinite, "epoch_skipped_before": self.skipped_before}

  def record(self, epoch: int, step: int, done: dict) -> dict:
    totals = {key: done["epoch_sums"].get(key, 0.0) for key in SUM_KEYS}
    weight = totals["weight_sum"]
    record = {"event": "epoch", "epoch": epoch + 1, "step": step,
              "train_loss": totals["loss_sum"] / weight if weight else None,
              "train_accuracy": totals["correct_sum"] / weight if weight else None,
              "train_examples": totals["count"], "train_time_s": done["epoch_train_time"]}
    if self.nonfinite:
      record["nonfinite_loss_steps"] = self.nonfinite  # left out of train_loss
    if self.rolled_back:
      record["rolled_back"] = True  # train_* count only the steps after the rollback
    return record
