"""The cluster benchmark end to end on its smallest configuration (benchmarks/sections/network/rig.py).

`python -m benchmarks network --on rig --quick`: one two-node rig at 1 Gbit/s per
node, 2 processes per node; a 1 MB all-reduce (Open MPI, hierarchical, jdist)
and a plain CNN step beside DDP under torchrun, 3 rounds each. The report
must hold every row with a measured time, and the rig must be gone after.

Needs root, iproute2 and util-linux (the rig); without them it skips with the
reason, except under CI, where it fails (CI runs as root). It launches its
own mpirun and torchrun jobs, so it runs from plain pytest only (its name
holds "subprocess").
"""

import json
import math
import os

import pytest

from benchmarks.harness import cluster
from benchmarks.harness.section import torch_missing
from benchmarks.sections.network import rig as cluster_bench
from benchmarks.sections.network import report as cluster_report
from tests import launch


@pytest.fixture(scope="module")
def rig_ready():
  launch.require(cluster.missing_requirements(), "the cluster rig")


def _positive(value) -> bool:
  return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.timeout(600)
def test_rig_quick_run_subprocess_reports_every_row(rig_ready, tmp_path):
  del rig_ready
  results = cluster_bench.run_all(quick=True, log=lambda line: None)
  written = cluster_bench.write_outputs(results, str(tmp_path))
  summary = results["summary"]
  assert summary["failures"] == [], summary["failures"]

  (row,) = summary["allreduce"]
  assert (row["link"], row["bytes"]) == ("1gbit", 1 << 20) and row["route"], row
  # The native engine sums node-aware on the rig; then jdist flat runs beside it.
  keys = ("mpi_s", "hierarchical_s", "jdist_s", "floor_s") + (
      ("jdist_flat_s",) if row["node_aware"] else ())
  for key in keys:
    assert _positive(row[key]), (key, row)
  # Nothing beats the link: every all-reduce moves at least the buffer once
  # (less the token bucket's 256 KB burst).
  assert min(row["mpi_s"], row["hierarchical_s"], row["jdist_s"]) >= 0.5 * row["floor_s"], row

  steps = {r["variant"]: r for r in summary["training"]}
  expected = {"compute", "plain"}
  if torch_missing() is None:
    expected |= {"torch_compute", "ddp"}
  else:
    assert any("torch" in reason for reason in results["skipped"]), results["skipped"]
  assert set(steps) == expected, sorted(steps)
  for variant in expected:
    assert _positive(steps[variant]["step_s"]), steps[variant]
  assert steps["plain"]["comm_s"] is not None
  # Net of the slowest rank's compute, round by round: never more than net of its own.
  for variant in expected - {"compute", "torch_compute"}:
    assert steps[variant]["comm_slowest_s"] <= steps[variant]["comm_s"] + 1e-12, steps[variant]
  if "ddp" in steps:
    assert steps["ddp"]["comm_s"] is not None
    assert steps["plain"]["comm_vs_reference"] is not None
    plain_targets = {t["target"]: t["measured"] for t in summary["targets"]
                     if "plain" in t["target"]}
    assert plain_targets == {
        cluster_report.TRAIN_TARGETS[0][0]: steps["plain"]["comm_vs_reference"],
        cluster_report.TRAIN_TARGETS[0][0] + cluster_report.SLOWEST_NOTE:
            steps["plain"]["comm_slowest_vs_reference"]}

  assert written == ["results.json", "results.md"]
  markdown = (tmp_path / "results.md").read_text()
  assert "| 1 MB |" in markdown and "| 1gbit | jdist (mpirun) | plain |" in markdown
  if "ddp" in steps:
    assert "| 1gbit | PyTorch DDP (gloo, torchrun) | ddp |" in markdown
  assert json.loads((tmp_path / "results.json").read_text())["links"] == ["1gbit"]
  tag = f"{cluster.PREFIX}{os.getpid() % 100000}"
  assert not [name for name in cluster.netns.list_names() if name.startswith(tag)]
