"""jdist.init and Topology."""

import socket
import sys

import pytest

import jdist
from jdist.runtime import topology as topology_lib
from tests import launch


def test_init_is_idempotent_and_consistent(topo):
  assert jdist.init() is topo
  assert topo.replica_count == topo.process_count * topo.local_device_count
  assert len(topo.replica_indices) == topo.local_device_count
  assert topo.replica_indices[0] == topo.process_index * topo.local_device_count
  assert topo.replica_index(0) == topo.replica_indices[0]
  assert topo.is_primary == (topo.process_index == 0)
  assert 0 <= topo.local_rank < topo.local_process_count
  assert topo.backend == ("mpi" if topo.process_count > 1 else "none")
  with pytest.raises(ValueError, match="out of range"):
    topo.replica_index(topo.local_device_count)


def test_init_rejects_conflicting_backend(topo):
  other = "jax" if topo.backend != "jax" else "none"
  with pytest.raises(ValueError, match="call init once"):
    jdist.init(backend=other)


def test_timeout_validation(monkeypatch):
  assert topology_lib.resolve_timeout(5) == 5.0
  monkeypatch.setenv(topology_lib.TIMEOUT_ENV, "42")
  assert topology_lib.resolve_timeout(None) == 42.0
  monkeypatch.setenv(topology_lib.TIMEOUT_ENV, "soon")
  with pytest.raises(ValueError, match="JDIST_TIMEOUT='soon'"):
    topology_lib.resolve_timeout(None)
  with pytest.raises(ValueError, match="positive"):
    topology_lib.resolve_timeout(-1)


def test_init_timeout_comes_from_the_environment_with_a_floor(monkeypatch):
  monkeypatch.delenv(topology_lib.INIT_TIMEOUT_ENV, raising=False)
  # Ranks may start far apart: the exchange timeout alone is too short.
  assert topology_lib.resolve_init_timeout(10.0) == topology_lib.MIN_INIT_TIMEOUT_S
  assert topology_lib.resolve_init_timeout(900.0) == 900.0
  monkeypatch.setenv(topology_lib.INIT_TIMEOUT_ENV, "5")
  assert topology_lib.resolve_init_timeout(900.0) == 5.0
  monkeypatch.setenv(topology_lib.INIT_TIMEOUT_ENV, "soon")
  with pytest.raises(ValueError, match="JDIST_INIT_TIMEOUT='soon'"):
    topology_lib.resolve_init_timeout(10.0)
  monkeypatch.setenv(topology_lib.INIT_TIMEOUT_ENV, "0")
  with pytest.raises(ValueError, match="JDIST_INIT_TIMEOUT='0' must be a positive"):
    topology_lib.resolve_init_timeout(10.0)


_WITHOUT_MPI4PY = (
    "import sys; sys.modules['mpi4py'] = None\n"
    "import jdist\n"
    "try:\n"
    "  jdist.init()\n"
    "except jdist.errors.MissingMPIError as err:\n"
    "  print('MISSING:', err)\n")


def test_mpirun_without_mpi4py_is_a_clear_error():
  env = launch.clean_env(1, OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
  result = launch.python(["-c", _WITHOUT_MPI4PY], env=env, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "MISSING:" in result.stdout and "mpi4py" in result.stdout
  assert "scripts/install.sh" in result.stdout


def test_launch_detection(monkeypatch):
  for name in topology_lib._LAUNCHER_SIZE_VARS:
    monkeypatch.delenv(name, raising=False)
  assert not topology_lib.launched_by_mpi()
  monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
  assert not topology_lib.launched_by_mpi()
  monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
  assert topology_lib.launched_by_mpi()


def test_subprocess_jax_backend_trains_like_one_device():
  result = launch.mpirun([sys.executable, "tests/jobs/backend_jax.py"], np=2, devices=2, timeout=240)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  assert result.stdout.count("OK rank") == 2
  assert "backend jax" in result.stdout


_GETTER = (
    "import sys\n"
    "import jdist\n"
    "from jdist.runtime import job\n"
    "try:\n"
    "  topo = jdist.get_topology()\n"
    "  print('TOPO', topo.process_count, topo.local_device_count, topo.route,\n"
    "        job.is_initialized())\n"
    "except jdist.errors.JdistError as err:\n"
    "  print('ERROR:', err)\n"
    "print('MPI STARTED:', 'mpi4py.MPI' in sys.modules)\n")


def test_getter_in_a_plain_process_is_one_process_without_mpi():
  result = launch.python(["-c", _GETTER], env=launch.clean_env(2), timeout=120)
  assert result.returncode == 0, result.stderr
  assert "TOPO 1 2 local False" in result.stdout  # nothing initialized
  assert "MPI STARTED: False" in result.stdout


def test_getter_under_an_mpi_launcher_names_init_and_starts_nothing():
  env = launch.clean_env(1, OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
  result = launch.python(["-c", _GETTER], env=env, timeout=120)
  assert result.returncode == 0, result.stderr
  assert "ERROR:" in result.stdout and "jdist.init()" in result.stdout
  assert "MPI STARTED: False" in result.stdout


def test_topology_names_the_started_route(topo):
  assert topo.route == jdist.collectives.route()
  assert f"route {topo.route}" in str(topo)


def test_nodes_are_numbered_by_their_lowest_rank():
  assert topology_lib.nodes_of(["b", "b", "a", "a", "c"]) == [0, 0, 1, 1, 2]
  assert topology_lib.nodes_of(["x"]) == [0]
  assert topology_lib.nodes_of(["n1", "n2", "n1", "n2"]) == [0, 1, 0, 1]


def test_topology_reports_this_processs_node(topo):
  assert 0 <= topo.node_index < topo.node_count <= topo.process_count
  assert topo.hostname == socket.gethostname()
  if topo.process_count == 1:
    assert topo.node_count == 1 and topo.node_index == 0
