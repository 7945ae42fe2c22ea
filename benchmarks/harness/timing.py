"""Timing shared by every benchmark: warm-up, interleaved rounds, medians (method:
docs/benchmarks/results.md); every timed call is waited for (`block_until_ready`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Mapping

import jax


@dataclasses.dataclass
class Series:
  """The timings of one variant."""
  samples: list[float]

  @property
  def median(self) -> float:
    return statistics.median(self.samples)

  def per(self, count: int) -> "Series":
    """The timings divided by `count` (a call that did `count` operations)."""
    return Series([sample / count for sample in self.samples])

  def as_dict(self, prefix: str = "") -> dict[str, Any]:
    """Median and spread, keys ending in `_s` (seconds) as the driver expects."""
    ordered = sorted(self.samples)
    return {f"{prefix}time_s": self.median, f"{prefix}min_s": ordered[0],
            f"{prefix}p90_s": ordered[int(0.9 * (len(ordered) - 1))],
            f"{prefix}repeats": len(ordered)}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
  """Seconds one call of `fn` takes, its result included, and the result."""
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return time.perf_counter() - start, out


def interleaved(variants: Mapping[str, Callable[[], Any]], *, repeats: int, warmup: int = 2,
                sync: Callable[[], None] | None = None) -> dict[str, Series]:
  """name -> `Series` of `variants` timed round-robin after a warm-up."""
  for _ in range(warmup):
    for fn in variants.values():
      timed(fn)
  if sync is not None:
    sync()
  samples: dict[str, list[float]] = {name: [] for name in variants}
  for _ in range(repeats):
    for name, fn in variants.items():
      samples[name].append(timed(fn)[0])
  return {name: Series(values) for name, values in samples.items()}


def paired_ratio(numerator: Series, denominator: Series) -> float:
  """Median of per-round ratios: each pair ran back to back, so drift cancels."""
  return statistics.median(a / b for a, b in zip(numerator.samples, denominator.samples))


def repeats_for(nbytes: int, *, quick: bool, budget_bytes: int = 1 << 28,
                least: int = 7, most: int = 60) -> int:
  """Repeats for a transfer of `nbytes` (the size only: every rank agrees): many when small."""
  if quick:
    return 3
  return max(least, min(most, budget_bytes // max(1, nbytes)))


class Stepper:
  """A training step feeding its own state back, one step a call."""

  def __init__(self, step: Callable, state: tuple, batch: tuple):
    self.step = step
    self.state = state
    self.batch = batch

  def __call__(self):
    out = self.step(*self.state, *self.batch)
    self.state = tuple(out[:len(self.state)])
    return out
