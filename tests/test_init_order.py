"""jdist.init() after JAX started its backends: a working run or a clear error, never a hang.

Under mpirun JAX's distributed runtime is on by default and must start
before JAX's backends, so a late init stops there; with it off
(JDIST_JAX_DISTRIBUTED=0), the thread pool decides. Each case launches its own job (a hang must fail the test, not the suite),
so these tests run in the plain session only (*subprocess*).
"""

import sys

import pytest

from tests import launch

JOB = "tests/jobs/late_init.py"
# A refusal comes before the first step: far below the deadlock's wait (the
# job was killed after 150-170 s in 2 x 2).
LIMIT_S = 150


def _run(processes: int, devices: int, **env: str):
  if processes == 1:
    return launch.python([JOB], devices=devices, timeout=LIMIT_S,
                         env=launch.clean_env(devices, **env))
  return launch.mpirun([sys.executable, JOB], np=processes, timeout=LIMIT_S,
                       env=launch.clean_env(devices, **env))


@pytest.mark.parametrize("processes, devices", [(1, 2), (2, 1)])
def test_late_init_works_where_nothing_depends_on_the_order_subprocess(processes, devices):
  done = _run(processes, devices, JDIST_JAX_DISTRIBUTED="0")
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
  assert done.stdout.count("OK rank") == processes, done.stdout


def test_late_init_with_several_cpu_devices_per_process_stops_at_once_subprocess():
  done = _run(2, 2, JDIST_JAX_DISTRIBUTED="0")
  assert done.returncode != 0 and "OK rank" not in done.stdout, done.stdout
  assert "InitOrderError" in done.stderr, done.stderr[-4000:]
  assert "call jdist.init() before any other JAX call" in done.stderr
  assert "NPROC=16" in done.stderr


def test_late_init_with_nproc_set_works_subprocess():
  """The error's second fix, as written: NPROC=16 in the environment."""
  done = _run(2, 2, JDIST_JAX_DISTRIBUTED="0", NPROC="16")
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
  assert done.stdout.count("OK rank") == 2, done.stdout


def test_late_init_in_2x2_with_jax_distributed_on_gives_advice_that_works_subprocess():
  """The default under mpirun: NPROC alone would only meet the distributed
  runtime's refusal, so the advice names both variables (the test above runs
  them, as written)."""
  done = _run(2, 2)
  assert done.returncode != 0 and "OK rank" not in done.stdout, done.stdout
  assert "InitOrderError" in done.stderr, done.stderr[-4000:]
  assert "call jdist.init() before any other JAX call" in done.stderr
  assert "mpirun -x NPROC=16 -x JDIST_JAX_DISTRIBUTED=0" in done.stderr
  # NPROC alone: the runtime's own refusal, whose advice (JDIST_JAX_DISTRIBUTED=0) completes it.
  nproc_only = _run(2, 2, NPROC="16")
  assert nproc_only.returncode != 0 and "OK rank" not in nproc_only.stdout, nproc_only.stdout
  assert "JAX's distributed runtime can no longer start" in nproc_only.stderr
  assert "JDIST_JAX_DISTRIBUTED=0" in nproc_only.stderr


def test_late_init_with_jax_distributed_on_stops_at_once_subprocess():
  """JAX's distributed runtime (on by default under mpirun) cannot start after its backends."""
  done = _run(2, 1)
  assert done.returncode != 0 and "OK rank" not in done.stdout, done.stdout
  assert "InitOrderError" in done.stderr, done.stderr[-4000:]
  assert "call jdist.init() before any other JAX call" in done.stderr
  assert "JDIST_JAX_DISTRIBUTED=0" in done.stderr
