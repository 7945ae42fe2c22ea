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
import sys
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


def _is_rig_test(nodeid: str) -> bool:
  name = nodeid.rsplit("::", 1)[-1].split("[", 1)[0]
  return "rig" in name.split("_")


def pytest_collection_modifyitems(config, items):
  """Holds the naming rule the scheduler below relies on: a rig test says `rig` in its name."""
  del config
  for item in items:
    if ("rig_ready" in getattr(item, "fixturenames", ())) != _is_rig_test(item.nodeid):
      raise pytest.UsageError(
          f"{item.nodeid}: a test needs the multi-node rig (the `rig_ready` fixture) exactly "
          "when its name has the word `rig` (test_rig_..., test_fault_rig_...): the "
          "scheduler in tests/conftest.py runs those one after another on one worker.")


def pytest_xdist_make_scheduler(config, log):
  """`--dist loadfile`, with the rig's tests as one more file.

  Each rig test builds network namespaces on a free 10.x subnet and kills
  what runs on them; two at once would race for the subnet. They live in
  several files, so a worker that met one while another held the rig would
  wait idle; as one work unit, they run one after another on one worker.
  """
  if config.getoption("dist") != "loadfile":
    return None
  from xdist.scheduler import LoadFileScheduling  # pylint: disable=g-import-not-at-top

  class RigAsOneFile(LoadFileScheduling):

    def _split_scope(self, nodeid: str) -> str:
      return "the multi-node rig" if _is_rig_test(nodeid) else super()._split_scope(nodeid)

  return RigAsOneFile(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Runs the rig's tests one at a time, across pytest processes too (a file lock)."""
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


def pytest_runtest_logreport(report):
  """Under mpirun, prints a failure at once, naming its rank.

  A test that fails on one rank only leaves the ranks in different places;
  their next exchange may then end the whole job before pytest's summary,
  which would have said what failed (a 2x1 suite run ended so, twice).
  """
  if not report.failed or not launch.under_mpirun():
    return
  rank = jdist.get_topology().process_index
  print(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}):\n"
        f"{report.longreprtext[-4000:]}\n[rank {rank}] end of {report.nodeid}",
        file=sys.__stderr__, flush=True)
