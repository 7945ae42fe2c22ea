"""The A/B's statistics (benchmarks/timeline_ab.py): the bootstrap interval
that decides whether a step-time target is shown."""

import random
import statistics

from benchmarks import timeline_ab


def test_interval_holds_the_median_and_narrows_with_more_rounds():
  rng = random.Random(1)
  few = [1.0 + rng.gauss(0, 0.05) for _ in range(20)]
  many = [1.0 + rng.gauss(0, 0.05) for _ in range(500)]
  low_few, high_few = timeline_ab.median_interval(few)
  low_many, high_many = timeline_ab.median_interval(many)
  assert low_few <= statistics.median(few) <= high_few
  assert low_many <= statistics.median(many) <= high_many
  assert high_many - low_many < (high_few - low_few) / 2


def test_interval_is_reproducible_and_separates_a_real_shift():
  rng = random.Random(2)
  shifted = [1.05 + rng.gauss(0, 0.02) for _ in range(60)]
  assert timeline_ab.median_interval(shifted) == timeline_ab.median_interval(shifted)
  low, _ = timeline_ab.median_interval(shifted)
  assert low > 1.02  # a 5% overhead is resolved as above a 2% target


def test_summary_reports_quartiles_and_interval():
  summary = timeline_ab.ratio_summary([0.9, 1.0, 1.1, 1.0, 1.0])
  assert summary["median"] == 1.0
  low, high = summary["ci95"]
  assert 0.9 <= low <= 1.0 <= high <= 1.1
