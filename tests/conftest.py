"""Test setup: fake local devices before JAX is imported.

The suite runs three ways (see scripts/test.sh):
  pytest                                        1 process  x 4 devices
  mpirun -np 2 pytest  (JDIST_TEST_DEVICES=1)   2 processes x 1 device
  mpirun -np 2 pytest  (JDIST_TEST_DEVICES=2)   2 processes x 2 devices
Every test compares against a single-device reference computed locally, so
the same assertions check all three topologies.
"""

import fcntl
import os
import tempfile

from tests import launch  # imports no JAX

os.environ["XLA_FLAGS"] = launch.xla_flags(int(os.environ.get("JDIST_TEST_DEVICES", "4")),
                                          os.environ.get("XLA_FLAGS", ""))
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
  launch.require(cluster.missing_requirements(), "the multi-node rig")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Runs the rig's tests one at a time, whichever pytest-xdist worker has them.

  Each builds network namespaces on a free 10.x subnet and kills what runs on
  them; two at once would race for the subnet. The tests of one file share a
  worker already (`--dist loadfile` in scripts/test.sh); the rig's are in
  several files, so a file lock orders them.
  """
  del nextitem
  if "rig_ready" not in getattr(item, "fixturenames", ()):
    return (yield)
  with open(os.path.join(tempfile.gettempdir(), f"jdist-tests-rig-{os.getuid()}.lock"),
            "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    return (yield)


@pytest.fixture(scope="session")
def topo():
  """The job's topology: 1x4 under plain pytest, 2xN under mpirun."""
  return jdist.init()


def pytest_report_header(config):
  return f"jdist test topology: {jdist.init()}"
