"""Launching separate `mpirun` jobs from a test (fault injection, CLI runs).

Tests that must end a whole MPI job (a stalled rank, a killed rank) cannot run
inside `mpirun pytest`: they start their own job here, with a hard timeout so
a hang fails the test instead of blocking CI.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests check logic and numerics against a reference compiled the same way,
# not the speed of the generated code, and most of their time is XLA compiling:
# LLVM's lighter optimization level 1 (below the default) halves it without slowing
# the training runs (level 0 does: a digits run went from 11 s to 87 s). Each
# program compiles as one LLVM module: two pytest workers, or a job's two ranks,
# already fill the cores, and XLA's parallel codegen only added work (the plain
# session took 753 s against 787-808 s with it, its processes 10% less CPU).
# Every session and every job a test launches gets both, so both sides of a
# comparison are compiled alike.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=1",
                  "--xla_cpu_parallel_codegen_split_count=1")
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def xla_flags(devices: int, inherited: str = "") -> str:
  """`XLA_FLAGS` for a test process: `devices` host devices, the test flags, the user's others.

  A flag the user set (in `inherited`) wins over the test default of the same name.
  """
  kept = [flag for flag in inherited.split() if not flag.startswith(_DEVICE_COUNT_FLAG)]
  names = {flag.split("=")[0] for flag in kept}
  defaults = [flag for flag in TEST_XLA_FLAGS if flag.split("=")[0] not in names]
  return " ".join(kept + defaults + [f"{_DEVICE_COUNT_FLAG}={devices}"])


def under_mpirun() -> bool:
  """Whether this pytest session is itself an MPI job (then it never launches jobs)."""
  import jdist  # pylint: disable=g-import-not-at-top (conftest has set up JAX first)
  return jdist.get_topology().process_count > 1


def mpirun_binary() -> str:
  here = os.path.join(os.path.dirname(sys.executable), "mpirun")
  return here if os.path.exists(here) else (shutil.which("mpirun") or "mpirun")


def clean_env(devices: int = 1, **extra: str) -> dict:
  """The environment for a child job: no inherited MPI rank variables."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_"))}
  env["XLA_FLAGS"] = xla_flags(devices)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  env["PYTHONUNBUFFERED"] = "1"
  env.update(extra)
  return env


def mpirun_argv(args, np: int = 2) -> list:
  argv = [mpirun_binary(), "-np", str(np), "--oversubscribe"]
  if hasattr(os, "geteuid") and os.geteuid() == 0:
    argv.append("--allow-run-as-root")
  return argv + list(args)


def mpirun(args, *, np: int = 2, devices: int = 1, timeout: float = 120,
           env: dict | None = None) -> subprocess.CompletedProcess:
  """Runs `mpirun -np N args...` and returns the finished process.

  Raises:
    subprocess.TimeoutExpired: the job did not end within `timeout` seconds
      (the job is killed first).
  """
  return run_own_session(mpirun_argv(args, np), env or clean_env(devices), timeout)


def python(args, *, devices: int = 1, timeout: float = 120,
           env: dict | None = None) -> subprocess.CompletedProcess:
  """Runs `python args...` as a plain single-process job."""
  return run_own_session([sys.executable] + list(args), env or clean_env(devices), timeout)


def _session_members(session: int) -> list:
  """Processes in session `session` (started with start_new_session)."""
  members = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as stat:
          fields = stat.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      if int(fields[3]) == session:  # field 6 of stat: the session id
        members.append(int(entry))
  return members


def run_own_session(argv, env, timeout: float) -> subprocess.CompletedProcess:
  """Runs `argv` in a session of its own; on timeout, ends the whole session.

  mpirun starts each rank in its own process group, so killing mpirun (or its
  group) would leave hung ranks behind; they all share mpirun's session.

  Raises:
    subprocess.TimeoutExpired: after every process of the session is killed.
  """
  process = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    stdout, stderr = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.terminate()  # mpirun forwards SIGTERM to its ranks
    try:
      process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass
    if sys.platform.startswith("linux"):
      for pid in _session_members(process.pid):
        with contextlib.suppress(ProcessLookupError):
          os.kill(pid, signal.SIGKILL)
    process.kill()
    stdout, stderr = process.communicate()
    raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr) from None
  return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def require(missing: list, what: str) -> None:
  """Skips the calling test when `missing` names what it lacks; fails instead under CI.

  CI runs as root with everything installed, so there a missing piece is a
  broken setup, not a reason to skip.
  """
  if missing:
    import pytest  # pylint: disable=g-import-not-at-top
    reason = f"{what} is unavailable here: " + "; ".join(missing)
    if os.environ.get("CI"):
      pytest.fail(reason + " (CI runs as root and must run these tests)")
    pytest.skip(reason)
