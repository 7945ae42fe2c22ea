"""A DiLoCo mode and its compute floors, step by step in the same job.

`<mode>_paired` in `python -m benchmarks time_to_accuracy`: one job (2
processes x 1 device, one link) trains the DiLoCo mode, the compute floor
(`train_to_target.FloorTrainer`: a bare `jax.jit` SGD step, nothing
exchanged) and the mode's own floor (`<mode>_nosync`: the same DiLoCo step
never syncing) from the same weights on the same batches, taking one step of
each in turn (the order rotating every step). Runs one after another on a
shared machine saw the floor's median step move from 19 to 24 ms between
jobs of the same code; side by side, every step of the three meets the same
machine, so their ratio is the one the time-to-accuracy target asks for.

The run's clock, curve and stop are the mode's own (its step times only);
the floors' cumulative training seconds after every step are in the final
row (`paired_floors`), read by `time_to_accuracy_targets.floor_targets`.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from benchmarks import accuracy
from benchmarks import train_to_target


class PairedTrainer:
  """`train_to_target`'s trainer interface; `step` returns (loss, the mode's seconds).

  Args:
    variant: `<mode>_paired`, `<mode>` a DiLoCo mode of `benchmarks.accuracy.MODES`.
    model, params, data, replicas: as `train_to_target.JdistTrainer`'s.

  Raises:
    ValueError: `<mode>` is not a DiLoCo mode.
  """

  framework = "jdist"

  def __init__(self, variant: str, model, params: Any, data, replicas,
               clock=time.perf_counter):
    mode = variant[:-len(accuracy.PAIRED)]
    if "diloco" not in accuracy.MODES.get(mode, {}) or accuracy.never_syncs(mode):
      raise ValueError(f"{variant!r}: {accuracy.PAIRED} pairs a DiLoCo mode (e.g. "
                       f"sdiloco32_int4{accuracy.PAIRED}) with its floors.")
    self.mode = mode
    self.main = train_to_target.JdistTrainer(mode, model, params, data, replicas)
    self.floors = {
        train_to_target.FLOOR: train_to_target.FloorTrainer(model, params, data, replicas),
        mode + accuracy.NO_SYNC: train_to_target.JdistTrainer(
            mode + accuracy.NO_SYNC, model, params, data, replicas)}
    self.floor_seconds: dict[str, list[float]] = {name: [] for name in self.floors}
    self.clock = clock
    self.turn = 0

  def step(self, indices) -> tuple[float, float]:
    order = [(None, self.main)] + list(self.floors.items())
    shift = self.turn % len(order)  # who goes first: every one in turn
    self.turn += 1
    loss, seconds = None, None
    for name, trainer in order[shift:] + order[:shift]:
      start = self.clock()
      value = trainer.step(indices)
      elapsed = self.clock() - start
      if name is None:
        loss, seconds = value, elapsed
      else:
        self.floor_seconds[name].append(elapsed)
    return loss, seconds

  def sync(self) -> None:
    self.main.sync()

  def evaluate(self) -> float:
    return self.main.evaluate()

  def wire_bytes(self) -> float | None:
    return self.main.wire_bytes()

  def details(self) -> dict[str, Any]:
    """Each floor's training seconds after steps 1, 2, ... (`[s - 1]`: after step s)."""
    return {"paired_mode": self.mode,
            "paired_floors": {name: [round(total, 6) for total in itertools.accumulate(times)]
                              for name, times in self.floor_seconds.items()}}
