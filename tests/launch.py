"""Launching separate `mpirun` jobs from a test (fault injection, CLI runs).

Tests that must end a whole MPI job (a stalled rank, a killed rank) cannot run
inside `mpirun pytest`: they start their own job here, with a hard timeout so
a hang fails the test instead of blocking CI.
"""

import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mpirun_binary() -> str:
  here = os.path.join(os.path.dirname(sys.executable), "mpirun")
  return here if os.path.exists(here) else (shutil.which("mpirun") or "mpirun")


def clean_env(devices: int = 1, **extra: str) -> dict:
  """The environment for a child job: no inherited MPI rank variables."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_"))}
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
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
  return subprocess.run(mpirun_argv(args, np), env=env or clean_env(devices), cwd=REPO,
                        capture_output=True, text=True, timeout=timeout)


def python(args, *, devices: int = 1, timeout: float = 120,
           env: dict | None = None) -> subprocess.CompletedProcess:
  """Runs `python args...` as a plain single-process job."""
  return subprocess.run([sys.executable] + list(args), env=env or clean_env(devices),
                        cwd=REPO, capture_output=True, text=True, timeout=timeout)
