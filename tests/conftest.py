"""Test setup: fake local devices before JAX is imported.

The suite runs three ways (see scripts/test.sh):
  pytest                                        1 process  x 4 devices
  mpirun -np 2 pytest  (JDIST_TEST_DEVICES=1)   2 processes x 1 device
  mpirun -np 2 pytest  (JDIST_TEST_DEVICES=2)   2 processes x 2 devices
Every test compares against a single-device reference computed locally, so
the same assertions check all three topologies.
"""

import os
import tempfile

_devices = int(os.environ.get("JDIST_TEST_DEVICES", "4"))
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if not f.startswith("--xla_force_host_platform_device_count")]
    + [f"--xla_force_host_platform_device_count={_devices}"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, the jobs tests launch
# included (they inherit the environment): the three sessions and dozens of
# `jdist train` jobs compile the same steps again and again. scripts/test.sh
# gives each run a fresh directory; a plain `pytest` uses this one.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"jdist-tests-jax-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# A stalled peer must fail the test run, not hang it.
os.environ.setdefault("JDIST_TIMEOUT", "120")

import jax  # noqa: E402  (must follow XLA_FLAGS)
import pytest  # noqa: E402

import jdist  # noqa: E402


@pytest.fixture(scope="session")
def rig_ready():
  """Skips (fails under CI) a test that needs the multi-node rig where it cannot be built."""
  from benchmarks.harness import cluster  # pylint: disable=g-import-not-at-top
  from tests import launch  # pylint: disable=g-import-not-at-top
  launch.require(cluster.missing_requirements(), "the multi-node rig")


@pytest.fixture(scope="session")
def topo():
  """The job's topology: 1x4 under plain pytest, 2xN under mpirun."""
  return jdist.init()


def pytest_report_header(config):
  return f"jdist test topology: {jdist.init()}"
