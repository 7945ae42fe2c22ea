"""What rank 0 tells the user about a training run: lines, a bar, a JSON-lines log.

`jdist.train.train` reports through a `RunOutput`: one plain-text line per
epoch on stdout (readable in any log, with or without the bar), a tqdm
progress bar on stderr, and a JSON-lines file with one record per epoch and
a final summary. Only the primary process (rank 0) speaks; on the others
every method does nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from jdist.config import TrainConfig


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
    if self._log is not None:
      self._log.write(json.dumps(record) + "\n")
      self._log.flush()

  def bar(self, epoch: int, total: int, initial: int):
    if not (self.primary and self.config.progress):
      return contextlib.nullcontext(None)
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    return tqdm(total=total, initial=initial, desc=f"epoch {epoch + 1}/{self.config.epochs}",
                unit="step", leave=False, dynamic_ncols=True, mininterval=0.5, file=sys.stderr)

  def close(self) -> None:
    if self._log is not None:
      self._log.close()


def epoch_line(record: dict, epochs: int) -> str:
  """The stdout line of one epoch record."""
  test = (f" | test loss {record['test_loss']:.4f} acc {record['test_accuracy']:.2%}"
          if "test_accuracy" in record else "")
  return (f"epoch {record['epoch']}/{epochs}: train loss {record['train_loss']:.4f} acc "
          f"{record['train_accuracy']:.2%}{test} | {record['epoch_time_s']:.1f} s, "
          f"{record['samples_per_s']:.0f} samples/s, "
          f"{human_bytes(record['wire_bytes_per_step'])}/step across processes")
