"""Node-aware sums in the native engine (jdist/collectives/native/hierarchy.h).

Which node map makes sums node-aware (`native.hierarchy_nodes`) is checked
here directly. The sums themselves run in jobs of their own
(tests/jobs/hierarchy_job.py, f32/bf16/f16/int32 buffers of odd sizes
against numpy's sum, node-aware and then switched to flat): four processes on this host with nodes emulated by
`JDIST_NATIVE_NODE_MAP`, and 2 nodes x 2 processes on the cluster rig
(`benchmarks.harness.cluster`, as root). They launch their own mpirun, so their names
hold "subprocess" (the plain session runs them).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax import numpy as jnp

from benchmarks.harness import cluster
from jdist.collectives import native
from tests import launch
from tests.jobs import hierarchy_job

JOB = [sys.executable, os.path.join(launch.REPO, "tests", "jobs", "hierarchy_job.py")]


def test_node_map_numbers_hosts_by_lowest_rank(monkeypatch):
  monkeypatch.delenv(native.NODE_MAP_ENV, raising=False)
  assert native.node_map(["b", "b", "a", "a"]) == [0, 0, 1, 1]
  assert native.node_map(["x", "y", "x", "y"]) == [0, 1, 0, 1]


def test_node_map_override_emulates_nodes(monkeypatch):
  monkeypatch.setenv(native.NODE_MAP_ENV, "0,1,0,1")
  assert native.node_map(["vm"] * 4) == [0, 1, 0, 1]
  monkeypatch.setenv(native.NODE_MAP_ENV, "0,0,1")
  with pytest.raises(ValueError, match="names 3 ranks' nodes; the job has 4 ranks"):
    native.node_map(["vm"] * 4)


@pytest.mark.parametrize("nodes, mode, expected", [
    ([0, 0, 1, 1], "auto", [0, 0, 1, 1]),  # several nodes, several processes each
    ([0, 1, 0, 1], "auto", [0, 1, 0, 1]),
    ([0, 1], "auto", None),                # one process per node: flat
    ([0, 0, 0, 0], "auto", None),          # one node: flat
    ([0, 0, 1, 1], "off", None),
    ([0, 0, 0, 0], "on", [0, 0, 0, 0]),    # forced: the four phases on one node
    ([0, 1], "on", [0, 1]),
])
def test_hierarchy_nodes_follows_the_mode(nodes, mode, expected):
  assert native.hierarchy_nodes(nodes, mode) == expected


def test_uneven_nodes_stay_flat_and_forcing_them_warns():
  assert native.hierarchy_nodes([0, 0, 0, 1], "auto") is None
  with pytest.warns(RuntimeWarning, match="sums stay flat"):
    assert native.hierarchy_nodes([0, 0, 0, 1], "on") is None


def test_hierarchy_mode_comes_from_the_environment(monkeypatch):
  monkeypatch.setenv(native.HIERARCHY_ENV, "off")
  assert native.hierarchy_nodes([0, 0, 1, 1]) is None
  monkeypatch.setenv(native.HIERARCHY_ENV, "sometimes")
  with pytest.raises(ValueError, match="choose 'auto', 'on' or 'off'"):
    native.hierarchy_nodes([0, 0, 1, 1])


def _expected_segments(segment_bytes: int | None, node_aware: bool = True) -> int:
  """Segments the job's sums cross in (each a sum of its own), as test_native counts.

  Whatever a process's devices, the wire carries one process's sum; by
  default node-aware sums cross in 256 KiB segments, flat ones in 4 MiB.
  """
  total = 0
  for dtype in hierarchy_job.DTYPES:
    for count in hierarchy_job.SIZES:
      wire = count * np.dtype(dtype).itemsize
      per = segment_bytes or ((256 << 10) if node_aware else (4 << 20))
      total += min(64, count, max(1, -(-wire // per)))
  return total


def _check_job(result, ranks: int, segment_bytes: int | None):
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
  assert sorted(row["rank"] for row in rows) == list(range(ranks)), result.stdout
  for row in rows:
    assert row["route"] == "native", row
    assert row["hierarchical"] is True, row
    assert row["failures"] == [], row
    assert row["segments"] == _expected_segments(segment_bytes), row
    assert row["flat_after_switch"] is True, row
    assert row["flat_failures"] == [], row
    assert row["flat_segments"] == _expected_segments(segment_bytes, node_aware=False), row
  assert len({row["digest"] for row in rows}) == 1, "ranks got different sums"
  assert len({row["flat_digest"] for row in rows}) == 1, "ranks got different flat sums"


@pytest.mark.parametrize("node_map, mode, segment_bytes, devices", [
    ("0,0,1,1", "auto", 1000, 1),   # many segments, uneven chunks at both levels
    ("0,1,0,1", "on", None, 1),     # nodes interleaved in rank order
    ("0,0,1,1", "auto", 1000, 2),   # two devices per process: the local sum first
])
def test_subprocess_emulated_nodes_sum_like_numpy(node_map, mode, segment_bytes, devices):
  extra = {native.NODE_MAP_ENV: node_map, native.HIERARCHY_ENV: mode}
  if segment_bytes:
    extra["JDIST_NATIVE_SEGMENT_BYTES"] = str(segment_bytes)
  env = launch.clean_env(devices, **extra)
  result = launch.mpirun(JOB, np=4, env=env, timeout=240)
  _check_job(result, 4, segment_bytes)




def test_rig_subprocess_node_aware_sums_match_numpy(rig_ready):
  """2 nodes x 2 processes x 1 device: node-aware by default (auto), whole
  segments and 1000-byte ones."""
  with cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
    for segment_bytes in (None, 1000):
      env = launch.clean_env(1)
      env.pop(native.HIERARCHY_ENV, None)
      env.pop(native.NODE_MAP_ENV, None)
      extra = ["-x", f"JDIST_NATIVE_SEGMENT_BYTES={segment_bytes}"] if segment_bytes else []
      if segment_bytes:
        env["JDIST_NATIVE_SEGMENT_BYTES"] = str(segment_bytes)
      process = rig.popen(JOB, 2, mpirun=launch.mpirun_binary(), extra=extra, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=launch.REPO)
      try:
        stdout, stderr = process.communicate(timeout=240)
      except subprocess.TimeoutExpired:
        process.kill()
        raise
      _check_job(subprocess.CompletedProcess(JOB, process.returncode, stdout, stderr), 4,
                 segment_bytes)


def test_set_hierarchical_needs_a_node_map():
  """Where the engine runs flat for want of a node map, it cannot be switched on."""
  launch.require([] if os.path.exists(native.CPU_LIBRARY) else
                 ["the native library is not built (scripts/install.sh builds it)"],
                 "the native engine")
  if native.hierarchical():
    assert native.set_hierarchical(True) is True
    return
  with pytest.raises(ValueError, match="without a node map"):
    native.set_hierarchical(True)
  assert native.set_hierarchical(False) is False
