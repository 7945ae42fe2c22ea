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


def pytest_collection_modifyitems(items):
  """Groups the tests for pytest-xdist's workers (`--dist loadgroup`): a file's on one worker.

  A file's module and session fixtures (the benchmarks' quick run) then run
  once, not once per worker. The rig's tests, in several files, share one
  group and run one after another: each builds network namespaces on a free
  10.x subnet and kills what runs on them, and two at once would race for the
  subnet. Under plain pytest the marks do nothing.
  """
  for item in items:
    rig = "rig_ready" in getattr(item, "fixturenames", ())
    item.add_marker(pytest.mark.xdist_group("rig" if rig else item.nodeid.split("::")[0]))


@pytest.fixture(scope="session")
def topo():
  """The job's topology: 1x4 under plain pytest, 2xN under mpirun."""
  return jdist.init()


def pytest_report_header(config):
  return f"jdist test topology: {jdist.init()}"
