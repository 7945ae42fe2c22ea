"""Smoke test of the emulated cluster network (benchmarks/harness/netns.py).

In one namespace whose loopback is shaped to 100 Mbit/s: a 2-rank raw MPI
all-reduce must take about what bytes / rate predict, and a 2-rank jdist
plain step must train over the link; every namespace must be gone
afterwards, also after a job that fails or leaves a process behind.

Needs root and iproute2 (`ip`, `tc`). Where they are missing the tests skip
with the reason, except under CI=true, where they fail (CI runs as root).
They launch their own jobs, so they run from plain pytest only.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks.harness import jobs as jobs_lib
from benchmarks.harness import netns
from benchmarks.sections.network import steps as network_steps
from tests import launch

RATE_MBIT = 100
ALLREDUCE_BYTES = 4 << 20
# Rank 0 prints the median of 3 all-reduces of ALLREDUCE_BYTES (float32) as JSON.
ALLREDUCE_CODE = f"""
import json, statistics, time
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
send = np.ones({ALLREDUCE_BYTES // 4}, np.float32)
recv = np.empty_like(send)
comm.Allreduce(send, recv)
times = []
for _ in range(3):
  comm.Barrier()
  start = time.perf_counter()
  comm.Allreduce(send, recv)
  times.append(time.perf_counter() - start)
assert recv[0] == comm.Get_size()
if comm.Get_rank() == 0:
  print(json.dumps({{"median_s": statistics.median(times)}}))
"""


@pytest.fixture(scope="module")
def link(topo):
  """A 100 Mbit/s link, or a skip (a failure under CI=true) naming what is missing."""
  if topo.process_count > 1:
    pytest.skip("starts its own MPI jobs: runs from plain pytest only")
  missing = netns.missing_requirements()
  if missing:
    message = "shaped network namespaces unavailable: " + "; ".join(missing)
    if os.environ.get("CI") == "true":
      pytest.fail(message + " (CI runs as root with iproute2 installed)")
    pytest.skip(message)
  return netns.Link("test-100mbit", RATE_MBIT)


def _in_namespace(name: str, args: list, timeout: float) -> subprocess.CompletedProcess:
  argv = netns.exec_prefix(name) + launch.mpirun_argv(list(netns.MPI_TCP_ARGS) + args)
  return launch.run_own_session(argv, launch.clean_env(), timeout)


@pytest.mark.timeout(60)
def test_shaped_link_is_as_slow_as_its_rate_predicts(link):
  with netns.shaped_namespace(link) as name:
    result = _in_namespace(name, [sys.executable, "-c", ALLREDUCE_CODE], timeout=45)
  assert result.returncode == 0, result.stderr[-2000:]
  measured = json.loads(result.stdout.strip().splitlines()[-1])["median_s"]
  # Two ranks on one shared link: about 2 x bytes cross it per all-reduce.
  predicted = 2 * ALLREDUCE_BYTES * 8 / (RATE_MBIT * 1e6)
  assert measured >= 0.5 * predicted, (measured, predicted)
  assert measured <= 10 * predicted, (measured, predicted)
  assert not netns.exists(name)


@pytest.mark.timeout(90)
def test_jdist_plain_step_trains_over_the_shaped_link(link):
  job = jobs_lib.Job("smoke@100mbit", 2, 1, (network_steps,), options=(
      ("model", "mlp-small"), ("modes", ["plain"]), ("handwritten", False),
      ("floor", False)))
  with netns.shaped_namespace(link) as name:
    job = jobs_lib.Job(job.name, 2, 1, job.sections, options=job.options,
                       prefix=tuple(netns.exec_prefix(name)), mpirun_args=netns.MPI_TCP_ARGS)
    result = jobs_lib.run(job, quick=True, timeout=75, log=lambda line: None)
  assert "error" not in result, result["error"]
  rows = {r["variant"]: r for r in result["sections"]["network"]["rows"]}
  assert set(rows) == {"compute", "plain"}
  plain = rows["plain"]
  # Each round's slowest compute step is at least this rank's own.
  assert plain["comm_vs_slowest_s"] <= plain["comm_paired_s"] + 1e-12, plain
  # The model's float32 gradients cross the 100 Mbit/s link each step.
  link_s = 2 * plain["wire_bytes"] * 8 / (RATE_MBIT * 1e6)
  assert plain["wire_bytes"] > 0 and plain["time_s"] - rows["compute"]["time_s"] >= 0.5 * link_s
  assert not netns.exists(name)


@pytest.mark.timeout(60)
def test_namespace_is_deleted_after_a_failing_job_and_an_exception(link):
  with pytest.raises(RuntimeError, match="harness failed"):
    with netns.shaped_namespace(link) as name:
      result = _in_namespace(name, [sys.executable, "-c", "import sys; sys.exit(3)"],
                             timeout=45)
      assert result.returncode != 0
      # A process left running inside (a hung rank) must not keep it alive.
      subprocess.Popen(netns.exec_prefix(name) + ["sleep", "300"], start_new_session=True)
      deadline = time.monotonic() + 10  # `ip netns exec` enters it a moment later under load
      while not netns.namespace_pids(name) and time.monotonic() < deadline:
        time.sleep(0.05)
      assert netns.namespace_pids(name)
      raise RuntimeError("harness failed")
  assert not netns.exists(name)
  assert name not in netns.list_names()
