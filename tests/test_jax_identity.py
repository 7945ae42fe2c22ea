"""JAX knows the processes: under mpirun, `jax.process_index()` is the MPI rank.

jdist.init() starts JAX's distributed runtime (`jdist.runtime.jax_distributed`),
so libraries that ask JAX who they are work unmodified and unguarded: orbax's
own `CheckpointManager`, `jax.experimental.multihost_utils` and grain's
`ShardByJaxProcess`. Run in every topology: 1x4 (one process, nothing to
start) and 2x1, 2x2 under mpirun.
"""

import os
import sys

import jax
import jax.numpy as jnp
import grain.python as grain  # jdist's [data] extra, in [dev]
import numpy as np
import pytest
from jax.experimental import multihost_utils

from jdist import errors
from jdist.runtime import host
from jdist.runtime import jax_distributed
from tests import launch


def _shared_dir(tmp_path) -> str:
  """One directory for every rank: rank 0's temporary directory."""
  return host.allgather_object(str(tmp_path), "test directory")[0]


def test_jax_process_index_and_count_are_the_mpi_rank_and_size(topo):
  assert jax.process_index() == topo.process_index
  assert jax.process_count() == topo.process_count
  assert jax.local_device_count() == topo.local_device_count
  assert len(jax.devices()) == topo.replica_count  # every process's devices
  assert {d.process_index for d in jax.local_devices()} == {topo.process_index}


def test_orbax_checkpoint_manager_unguarded_on_every_rank(topo, tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  directory = os.path.join(_shared_dir(tmp_path), "orbax")
  state = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3), "step": np.int32(7)}
  with ocp.CheckpointManager(directory) as manager:  # every rank, no rank-0 guard
    for step in (1, 2):
      manager.save(step, args=ocp.args.StandardSave({**state, "step": np.int32(step)}))
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]
    restored = manager.restore(2, args=ocp.args.StandardRestore())
  np.testing.assert_array_equal(restored["w"], state["w"])
  assert int(restored["step"]) == 2
  assert sorted(os.listdir(directory)) == ["1", "2"]  # no temporary directories left behind


def test_multihost_utils_work(topo):
  ranks = multihost_utils.process_allgather(np.array([topo.process_index], np.int32))
  np.testing.assert_array_equal(np.ravel(ranks), np.arange(topo.process_count))
  multihost_utils.sync_global_devices("jdist test")
  multihost_utils.assert_equal(np.arange(3), "every rank holds the same array")
  mine = jnp.full((2,), float(topo.process_index))
  everyone = multihost_utils.process_allgather(mine, tiled=False)
  np.testing.assert_array_equal(np.asarray(everyone)[:, 0], np.arange(topo.process_count))


def test_multihost_broadcast_and_global_arrays(topo):
  tree = {"a": np.full((2, 3), float(topo.process_index + 1), np.float32),
          "b": np.int32(10 * topo.process_index + 5)}
  out = multihost_utils.broadcast_one_to_all(tree)  # from process 0
  np.testing.assert_array_equal(out["a"], np.ones((2, 3), np.float32))
  assert int(out["b"]) == 5
  last = topo.process_count - 1
  out = multihost_utils.broadcast_one_to_all(tree, is_source=topo.process_index == last)
  np.testing.assert_array_equal(out["a"], np.full((2, 3), float(last + 1), np.float32))
  # A global array over every process's devices, one row per device.
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  rows = [jax.device_put(np.full((1, 2), float(d.id), np.float32), d) for d in jax.local_devices()]
  global_array = jax.make_array_from_single_device_arrays((len(jax.devices()), 2), sharding, rows)
  gathered = multihost_utils.process_allgather(global_array, tiled=True)
  expected = np.repeat(np.array([float(d.id) for d in jax.devices()], np.float32)[:, None], 2, 1)
  np.testing.assert_array_equal(gathered, expected)


def test_xla_cpu_collectives_stay_inside_each_process(topo):
  # Gloo would carry every XLA sum over TCP, a sum inside one process included.
  expected = None if topo.process_count > 1 else jax.config.jax_cpu_collectives_implementation
  assert jax.config.jax_cpu_collectives_implementation == expected
  if topo.process_count > 1:
    with pytest.raises(ValueError, match="rank 1"):
      multihost_utils.process_allgather(np.zeros(topo.process_index + 1))


def test_grain_shard_by_jax_process_gives_each_rank_its_own_shard(topo):
  records = list(range(12))
  sampler = grain.IndexSampler(num_records=len(records), shard_options=grain.ShardByJaxProcess(),
                               shuffle=False, num_epochs=1, seed=0)
  loader = grain.DataLoader(data_source=records, sampler=sampler, worker_count=0)
  mine = [int(x) for x in loader]
  everyone = host.allgather_object(mine, "grain shards")
  assert len(mine) == len(records) // topo.process_count
  assert sorted(sum(everyone, [])) == records  # disjoint shards that cover the data


def test_the_switch_reads_the_environment(monkeypatch):
  monkeypatch.delenv(jax_distributed.ENV, raising=False)
  assert jax_distributed.wanted(None) and not jax_distributed.wanted(False)
  monkeypatch.setenv(jax_distributed.ENV, "0")
  assert not jax_distributed.wanted(None) and jax_distributed.wanted(True)
  monkeypatch.setenv(jax_distributed.ENV, "maybe")
  with pytest.raises(ValueError, match=jax_distributed.ENV):
    jax_distributed.wanted(None)


_PRINT_IDENTITY = ("import jax, jdist; topo = jdist.init(); "
                   "print('IDENTITY', topo.process_index, jax.process_index(), jax.process_count())")


@pytest.mark.parametrize("value, expected", [("1", {"IDENTITY 0 0 2", "IDENTITY 1 1 2"}),
                                             ("0", {"IDENTITY 0 0 1", "IDENTITY 1 0 1"})])
def test_jax_distributed_can_be_turned_off_subprocess(value, expected):
  done = launch.mpirun([sys.executable, "-c", _PRINT_IDENTITY], devices=2, timeout=120,
                       env=launch.clean_env(2, JDIST_JAX_DISTRIBUTED=value))
  assert done.returncode == 0, done.stderr[-3000:]
  assert {line for line in done.stdout.splitlines() if line.startswith("IDENTITY")} == expected
  assert "Gloo" not in done.stdout + done.stderr  # no foreign banner lines


def test_an_unreachable_coordinator_is_a_clear_error_not_a_hang_subprocess():
  # The clients are sent to a port nobody listens on (rank 0's service binds another).
  env = launch.clean_env(1, JAX_COORDINATOR_ADDRESS="127.0.0.1:23456",
                         JAX_COORDINATOR_BIND_ADDRESS="[::]:23457", JDIST_COORDINATOR_TIMEOUT="4")
  done = launch.mpirun([sys.executable, "-c", _PRINT_IDENTITY], timeout=90, env=env)
  assert done.returncode != 0 and "IDENTITY" not in done.stdout
  assert errors.CoordinatorError.__name__ in done.stderr, done.stderr[-3000:]
  assert "could not connect to JAX's coordinator at 127.0.0.1:23456" in done.stderr
  assert "JDIST_JAX_DISTRIBUTED=0" in done.stderr


_COMPILE_TWO_PROGRAMS = """
import jax, jax.numpy as jnp, jdist, numpy as np
jdist.init()
def own_program(x):  # this process's devices only, as jdist's steps
  return x * 3.0 + 1.0
def spanning_program(x):  # over every process's devices
  return x * 5.0
jax.block_until_ready(jax.jit(own_program)(jnp.ones(3)))
everyone = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
batch = jax.make_array_from_process_local_data(
    jax.sharding.NamedSharding(everyone, jax.sharding.PartitionSpec("x")),
    np.ones((jax.local_device_count(), 3), np.float32))
jax.block_until_ready(jax.jit(spanning_program)(batch))
"""


def test_every_rank_writes_its_own_programs_to_jaxs_cache_subprocess(tmp_path):
  """JAX writes its persistent cache from process 0 only; a program over one
  process's devices is that process's alone, so each rank writes its own
  (a restarted job's ranks then find theirs), and one spanning every
  process (XLA's CPU client runs those only with cross-process collectives:
  Gloo here, the user's choice) is still written once."""
  cache = tmp_path / "cache"
  env = launch.clean_env(2, JAX_COMPILATION_CACHE_DIR=str(cache),
                         JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                         JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
  done = launch.mpirun([sys.executable, "-c", _COMPILE_TWO_PROGRAMS], devices=2, timeout=120,
                       env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  entries = os.listdir(cache)
  assert len([e for e in entries if e.startswith("jit_own_program-")]) == 2, entries
  assert len([e for e in entries if e.startswith("jit_spanning_program-")]) == 1, entries
