"""What rank 0 tells the user about a training run: lines, a bar, a JSON-lines log.

`jdist.app.train.train` reports through a `RunOutput`: one plain-text line per
epoch on stdout (readable in any log, with or without the bar), a tqdm
progress bar on stderr, and a JSON-lines file with one record per epoch and
a final summary. Only the primary process (rank 0) speaks; on the others
every method does nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

from tqdm import tqdm

from jdist.app.config import TrainConfig


def human_bytes(count: float) -> str:
  """1234567 -> "1.23 MB" (decimal units, as network rates are quoted)."""
  for unit in ("B", "KB", "MB", "GB"):
    if abs(count) < 1000 or unit == "GB":
      return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
    count /= 1000


class RunOutput:
  """Rank 0's voice: stdout lines, the progress bar and the JSON-lines log."""

  def __init__(self, config: TrainConfig, primary: bool):
    self.config, self.primary, self._log = config, primary, None

  def open_log(self, append: bool) -> None:
    if self.primary and self.config.log_file:
      directory = os.path.dirname(os.path.abspath(self.config.log_file))
      os.makedirs(directory, exist_ok=True)
      self._log = open(self.config.log_file, "a" if append else "w", encoding="utf-8")

  def say(self, text: str) -> None:
    if self.primary:
      print(text, flush=True)

  def record(self, record: dict) -> None:
    """Writes one JSON line; a NaN or Inf number is written as null (standard JSON)."""
    if self._log is not None:
      self._log.write(json.dumps(finite_json(record), allow_nan=False) + "\n")
      self._log.flush()

  def bar(self, epoch: int, total: int, initial: int):
    if not (self.primary and self.config.progress):
      return contextlib.nullcontext(None)
    return tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}/{self.config.epochs}",
                unit="step", leave=False, dynamic_ncols=True, mininterval=0.5, file=sys.stderr)

  def close(self) -> None:
    if self._log is not None:
      self._log.close()


def finite_json(value):
  """`value` with every non-finite float replaced by None, recursively."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {key: finite_json(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [finite_json(item) for item in value]
  return value


def _show(value, spec: str) -> str:
  return "n/a" if value is None else format(value, spec)


def epoch_line(record: dict, epochs: int) -> str:
  """The stdout line of one epoch record."""
  test = (f" | test loss {_show(record['test_loss'], '.4f')} acc "
          f"{_show(record['test_accuracy'], '.2%')}" if "test_accuracy" in record else "")
  notes = []
  if record.get("skipped_steps"):
    notes.append(f"{record['skipped_steps']} non-finite steps skipped")
  if record.get("nonfinite_loss_steps"):
    notes.append(f"{record['nonfinite_loss_steps']} steps with a non-finite loss left out "
                 f"of the train metrics")
  if "outer_syncs" in record:  # --diloco, --local-sgd
    notes.append(f"{record['outer_syncs']} outer syncs so far")
  if record.get("rolled_back"):
    notes.append("rolled back: train metrics count the steps since")
  note = f" ({'; '.join(notes)})" if notes else ""
  return (f"epoch {record['epoch']}/{epochs}: train loss {_show(record['train_loss'], '.4f')} "
          f"acc {_show(record['train_accuracy'], '.2%')}{note}{test} | "
          f"{record['epoch_time_s']:.1f} s, "
          f"{record['samples_per_s']:.0f} samples/s, "
          f"{human_bytes(record['wire_bytes_per_step'])}/step across processes")
