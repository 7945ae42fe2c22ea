"""The jit style's checks across processes: a global batch that differs per rank,
and parameters that start different (tests/jobs/jit_checks.py under mpirun).

Each test starts its own MPI job (the mistake ends it), so they are named
test_fault_* and run in the plain session only.
"""

import os
import sys
import time

import pytest

from tests import launch

JOB = [sys.executable, os.path.join(launch.REPO, "tests", "jobs", "jit_checks.py")]
TIMEOUT = 10.0  # the job's watchdog deadline
STARTUP_S = 120.0  # imports, MPI and JAX set-up, compiles on a loaded 2-core machine


def _run(fault: str, devices: int, steps: int = 6):
  started = time.monotonic()
  result = launch.mpirun(JOB + ["--fault", fault, "--timeout", str(TIMEOUT), "--steps",
                                str(steps)], np=2, env=launch.clean_env(devices),
                         timeout=STARTUP_S + 3 * TIMEOUT)
  return result, time.monotonic() - started


def _explain(result) -> str:
  return f"exit {result.returncode}\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"


@pytest.mark.parametrize("devices", [1, 2])
def test_fault_global_batch_of_another_size_on_one_rank_ends_the_job(devices):
  result, _ = _run("batch", devices)
  assert result.returncode != 0, _explain(result)
  rows = (f"rank 0: 64 rows (['x'] float32[64, 16], ['y'] int32[64]); "
          f"rank 1: 48 rows (['x'] float32[48, 16], ['y'] int32[48])")
  assert "ShapeError: jdist.shard_global_batch: the processes passed different global " \
         "batches: " + rows in result.stderr, _explain(result)
  assert "jdist-job: rank 0 step 1\n" not in result.stderr, _explain(result)  # before any step


@pytest.mark.parametrize("devices", [1, 2])
def test_fault_global_batch_changing_on_one_rank_ends_the_job_at_the_deadline(devices):
  result, _ = _run("batch_later", devices, steps=20)
  assert result.returncode != 0, _explain(result)
  assert "jdist-job: done" not in result.stderr, _explain(result)
  assert ("jdist watchdog: rank 1 waited" in result.stderr
          and "(rank 1 passes 48 rows (['x'] float32[48, 16], ['y'] int32[48]), after 64 rows "
          "(['x'] float32[64, 16], ['y'] int32[64]) until now)" in result.stderr), _explain(result)


def test_fault_parameters_seeded_per_rank_are_named_at_the_first_step():
  result, _ = _run("params", 1)
  assert result.returncode != 0, _explain(result)
  assert ("WorldMismatchError: jdist.dist_opt: the processes start from different parameters: "
          "rank(s) 1 hold other values than rank 0" in result.stderr), _explain(result)
  assert "params = jdist.broadcast_params(params) before tx.init(params)" in result.stderr
  assert "jdist-job: rank 0 step 1\n" not in result.stderr, _explain(result)


def test_correct_jit_job_runs_to_the_end_subprocess():
  result, _ = _run("none", 1)
  assert result.returncode == 0, _explain(result)
  assert result.stderr.count("jdist-job: done") == 2, _explain(result)
