"""Different host collectives meeting across ranks end the job with a report.

Every host exchange (`jdist.barrier`, `broadcast_params`, `host_allreduce`,
the structure checks, every `CheckpointManager` call...) starts with one
gather of each rank's call, so two different ones that meet (a collective
called inside `if topo.is_primary:`) are told apart there: the job ends with
the report naming each rank's call and line, not with an internal error of
payloads paired wrongly.

The report's helpers are unit-tested in every topology. The fault tests
(names contain "fault") launch their own 2-process job
(`tests/jobs/diverged_host.py`) under mpirun with a hard timeout, from plain
pytest only (under mpirun they skip: a job launched from inside an MPI job
would inherit its world).
"""

import concurrent.futures
import sys

import pytest

import jdist
from jdist.runtime import flight_report
from jdist.runtime import stall_report
from tests import launch
from tests.jobs import faults

JOB = "tests/jobs/diverged_host.py"
TIMEOUT = 60.0  # the watchdog's deadline in the jobs: the report must come well before
WITHIN = 25.0  # seconds from the divergence to the end of the job
_JOBS = {"barrier_2x1": ("barrier", 1), "broadcast_2x1": ("broadcast", 1),
         "allreduce_2x2": ("allreduce", 2)}
_CALLS = {"barrier": "jdist.barrier", "broadcast": "structure check of jdist.broadcast_params",
          "allreduce": "structure check of jdist.host_allreduce"}


def test_report_names_each_ranks_call_and_line():
  calls = {0: {"label": "jdist checkpoint: list steps", "where": "train.py:41 in main",
               "host": 11},
           1: {"label": "jdist.barrier", "where": "train.py:43 in main", "host": 11},
           2: {"label": "jdist.barrier", "where": "train.py:43 in main", "host": 11}}
  text = stall_report.describe_diverged_calls(1, calls)
  assert text.startswith("jdist watchdog: rank 1: the ranks called different host collectives "
                         "(host exchange 11)")
  assert "rank 0 is in jdist checkpoint: list steps at train.py:41 in main" in text
  assert "ranks 1, 2 are in jdist.barrier at train.py:43 in main" in text
  assert "if topo.is_primary:" in text and text.endswith("Aborting the job.")


def _host_row(number, label, age=1.0):
  return {"ordinal": number, "call": 0, "kind": "host", "nbytes": 0, "state": "done",
          "age_s": age, "label": label}


def test_flight_recorder_tells_a_host_exchange_of_different_calls():
  recorders = {0: {"entries": [_host_row(10, "jdist.barrier", 2.0),
                               _host_row(11, "jdist checkpoint: list steps")], "host": 11},
               1: {"entries": [_host_row(10, "jdist.barrier", 2.0),
                               _host_row(11, "jdist.barrier")], "host": 11}}
  found = flight_report.first_divergence(recorders)
  assert found["ordinal"] == 11 and found["never"] == []
  assert found["labels"] == {0: "jdist checkpoint: list steps", 1: "jdist.barrier"}
  text = flight_report.describe(recorders, 2)
  assert ("the ranks first disagree at host exchange 11, first posted 1.0 s ago, a different "
          "call on each side: rank 0 posted jdist checkpoint: list steps, rank 1 posted "
          "jdist.barrier.") in text


@pytest.fixture(scope="module")
def diverged_jobs(tmp_path_factory):
  """Starts every job at once (two at a time); maps job name to a future."""
  if launch.under_mpirun():
    yield {}  # never launch a job from inside an MPI job
    return
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    futures = {}
    for name, (then, devices) in _JOBS.items():
      args = [sys.executable, JOB, "--timeout", str(TIMEOUT), "--then", then,
              "--directory", str(tmp_path_factory.mktemp(name))]
      futures[name] = pool.submit(faults.run_args, args, devices=devices,
                                  hard_limit=faults.STARTUP_S + TIMEOUT)
    yield futures
    for future in futures.values():
      future.cancel()


@pytest.mark.parametrize("job", list(_JOBS))
def test_fault_different_host_collectives_end_the_job_naming_ranks_and_calls(diverged_jobs,
                                                                               job):
  if launch.under_mpirun():
    pytest.skip("fault jobs are launched from plain pytest only")
  result = diverged_jobs[job].result()
  faults.report(job, result)
  explain = (f"exit {result.returncode} after {result.elapsed:.1f} s\n"
             f"stdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-5000:]}")
  assert result.returncode != 0 and "jdist-job: done" not in result.stdout, explain
  assert result.since("diverging") < WITHIN < TIMEOUT, explain
  call = _CALLS[_JOBS[job][0]]
  for text in ("the ranks called different host collectives",
               f"rank 0 is in jdist checkpoint: list steps at {JOB}:",
               f"rank 1 is in {call} at {JOB}:",
               "a different call on each side: rank 0 posted jdist checkpoint: list steps, "
               f"rank 1 posted {call}."):
    assert text in result.stderr, explain
  for text in ("too many values to unpack", "unhashable type", "MPI_ERR_TRUNCATE",
               "Traceback"):
    assert text not in result.stderr, explain
