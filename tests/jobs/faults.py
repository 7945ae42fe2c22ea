"""Running `tests/jobs/stall.py` under mpirun and reading what it reports.

Used by tests/test_watchdog.py (and benchmarks/stall_repeat.py until commit d7ea04b). Needs no
JAX: it only launches the job and parses its output.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import time

from tests import launch

JOB = "tests/jobs/stall.py"
# Seconds a job may take to start (imports, MPI and JAX set-up, first
# compile) on a heavily loaded 2-core machine, on top of what its faults take.
# Only a hung job ever waits this long.
STARTUP_S = 120.0


@dataclasses.dataclass
class JobResult:
  returncode: int
  stdout: str
  stderr: str
  ended: float  # unix time the job ended (after mpirun returned)
  elapsed: float  # seconds the whole job took

  def fault_started(self, what: str) -> float:
    """Unix time rank 1 reported starting `what` (e.g. "sleeping", "killing")."""
    match = re.search(rf"jdist-job: rank \d+ {what}.* at ([0-9.]+)", self.stderr)
    if match is None:
      raise AssertionError(f"the job never reported {what!r}; stderr:\n{self.stderr[-3000:]}")
    return float(match.group(1))

  def since(self, what: str) -> float:
    """Seconds from the start of fault `what` to the end of the job."""
    return self.ended - self.fault_started(what)


def run(faults, *, processes: int = 2, devices: int = 1, timeout: float = 10.0, extra=(),
        hard_limit: float | None = None, env: dict | None = None) -> JobResult:
  """Runs the job with `faults` (e.g. ["stall:5"]): under mpirun, or plain
  `python` when `processes` is 1.

  Raises:
    subprocess.TimeoutExpired: the job hung past `hard_limit` seconds
      (default: STARTUP_S + 3 x timeout); every process of the job is killed.
  """
  args = [sys.executable, JOB, "--timeout", str(timeout)]
  for fault in faults:
    args += ["--fault", fault]
  args += list(extra)
  limit = hard_limit if hard_limit is not None else STARTUP_S + 3 * timeout
  return run_args(args, processes=processes, devices=devices, hard_limit=limit, env=env)


def run_args(args, *, processes: int = 2, devices: int = 1, hard_limit: float = STARTUP_S,
             env: dict | None = None) -> JobResult:
  """Runs `args` (a command line) under mpirun, or plain when `processes` is 1.

  Raises:
    subprocess.TimeoutExpired: the job hung past `hard_limit` seconds; every
      process of the job is killed.
  """
  argv = list(args) if processes == 1 else launch.mpirun_argv(args, np=processes)
  started = time.time()
  done = launch.run_own_session(argv, launch.clean_env(devices, **(env or {})), hard_limit)
  return JobResult(done.returncode, done.stdout, done.stderr, time.time(), time.time() - started)


def check_stall_abort(result: JobResult, timeout: float, step: int = 5) -> str | None:
  """Why `result` is not a correct watchdog abort of a stall at `step`, or None."""
  if result.returncode == 0:
    return "the job exited 0"
  try:
    to_abort = result.since("sleeping")
  except AssertionError:
    return "the stall never started"
  if to_abort > timeout + 15:
    return f"the job ended {to_abort:.1f} s after the stall began (limit {timeout + 15:g} s)"
  if "rank 1: MISSING" not in result.stderr:
    return "the watchdog's report does not name rank 1 as missing"
  if f"step {step} of train_step" not in result.stderr:
    return f"the watchdog's report does not name step {step} of train_step"
  return None


def report(name: str, result: JobResult) -> None:
  """Appends one line (job, exit status, seconds, first jdist line) to the file named by
  $JDIST_FAULT_REPORT, if set: the numbers behind docs/reliability.md's table."""
  path = os.environ.get("JDIST_FAULT_REPORT")
  if not path:
    return
  lines = [line for line in (result.stderr + "\n" + result.stdout).splitlines()
           if line.startswith(("jdist", "warning", "note", "resumed", "done"))
           and not line.startswith("jdist-job")]
  with open(path, "a", encoding="utf-8") as stream:
    stream.write(json.dumps({"job": name, "exit": result.returncode,
                             "seconds": round(result.elapsed, 1),
                             "first": lines[0] if lines else None}) + "\n")


TimeoutExpired = subprocess.TimeoutExpired
