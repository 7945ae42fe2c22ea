"""The quickstart examples run as a user runs them: one process, and under mpirun (2x2).

examples/quickstart.py is the jit-with-sharding style, whose steps jdist does
not dispatch itself: a rank that reached the end of the script with steps
still in flight once aborted the whole job while finalizing (2x2).
"""

import os
import subprocess
import sys

import pytest

from tests import launch

EPOCHS = 5


def _example(name):
  return os.path.join(launch.REPO, "examples", name)


@pytest.mark.parametrize("name", ["quickstart.py", "quickstart_data_parallel.py"])
def test_quickstart_one_process_subprocess(name):
  done = subprocess.run([sys.executable, _example(name)], env=launch.clean_env(devices=4),
                        capture_output=True, text=True, timeout=240, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  lines = [line for line in done.stdout.splitlines() if line.startswith("epoch")]
  assert len(lines) == EPOCHS and lines[-1].endswith("on 4 replicas")
  first, last = (float(line.split("loss ")[1].split()[0]) for line in (lines[0], lines[-1]))
  assert last < first


def test_quickstart_two_processes_two_devices_subprocess():
  done = launch.mpirun([sys.executable, _example("quickstart.py")], np=2, devices=2,
                       timeout=240)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  lines = [line for line in done.stdout.splitlines() if line.startswith("epoch")]
  assert len(lines) == EPOCHS and lines[-1].endswith("on 4 replicas")
