"""Checkpoints keep every replica's state and refuse what does not fit.

Under mpirun every rank runs each test; rank 0 picks the directory and every
rank uses it (ranks share /tmp here, as a real job shares its filesystem).
`test_fault_*` launches and SIGKILLs its own writer process: run it from plain
pytest (`-k "not fault"` under mpirun); `test_unfinished_write_is_ignored` is
its cheap equivalent in every topology.
"""

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jdist
from jdist import errors
from jdist.checkpoint import layout
from jdist.checkpoint.manager import CheckpointManager
from jdist.runtime import host
from tests import launch
from tests import reference
from tests.jobs import ckpt_global_writer as nnx_job
from tests.jobs import ckpt_writer

PER_REPLICA = 2
WRITER = os.path.join(launch.REPO, "tests", "jobs", "ckpt_writer.py")
GLOBAL_WRITER = os.path.join(launch.REPO, "tests", "jobs", "ckpt_global_writer.py")
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def _on_rank0(fn):
  """Runs fn on rank 0 only; the others wait, so its effect is seen by all."""
  error = None
  if jdist.init().is_primary:
    try:
      fn()
    except Exception as err:  # pylint: disable=broad-except
      error = err
  outcome = host.allgather_object(None if error is None else repr(error))[0]
  if error is not None:
    raise error
  if outcome is not None:
    pytest.fail(f"rank 0 failed: {outcome}")


@pytest.fixture
def shared_dir():
  path = tempfile.mkdtemp(prefix="jdist_ckpt_") if jdist.init().is_primary else None
  path = host.allgather_object(path)[0]
  yield path
  _on_rank0(lambda: shutil.rmtree(path, ignore_errors=True))


def _trained(topo, **dist_opt_args):
  """TinyMLP params and optimizer state after 2 steps of dist_opt(sgd, ...)."""
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(0), x0)
  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=s) for s in (1, 2)]
  tx = jdist.dist_opt(optax.sgd(0.1, momentum=0.9), **dist_opt_args)
  replicated, opt_state = reference.train_jdist(model, params, tx, batches, 2, topo,
                                                PER_REPLICA)
  fresh = jdist.replicate(params)
  return ({"params": replicated, "opt_state": opt_state},
          {"params": fresh, "opt_state": jdist.data_parallel(tx.init)(fresh)})


@functools.lru_cache(maxsize=None)
def _states(mode):
  topo = jdist.init()
  args = {"plain": {}, "topk": {"sparsify": "topk:0.1"}, "partial": {"partial": 3}}[mode]
  return _trained(topo, **args)


def _replicas_differ(tree):
  """Per leaf path: does any replica of the whole job hold other values?"""
  mine = [jax.tree.leaves(r) for r in jdist.local_replicas(tree)]
  everyone = [r for rank in host.allgather_object(mine) for r in rank]
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  return {path: any(not np.array_equal(r[i], everyone[0][i]) for r in everyone)
          for i, path in enumerate(paths)}


def _assert_same_replicas(actual, expected):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    assert a.dtype == b.dtype and a.shape == b.shape, jax.tree_util.keystr(path)
    # Placements must agree, not their spelling: on one device P('data') and
    # P() are the same, and XLA reports a zero-size output as replicated.
    assert a.size == 0 or a.sharding.is_equivalent_to(b.sharding, a.ndim), (
        jax.tree_util.keystr(path))
    if layout.is_key(a.dtype):
      assert jax.random.key_impl(a) == jax.random.key_impl(b)
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("mode", ["topk", "partial"])
def test_round_trip_keeps_every_replicas_state(topo, shared_dir, mode):
  state, template = _states(mode)
  differ = _replicas_differ(state)
  if topo.replica_count > 1:  # otherwise there is nothing per replica to keep
    assert any(differ.values()), "the test state should differ per replica"
  manager = CheckpointManager(shared_dir)
  meta = {"step": 2, "epoch": np.int64(0), "batch_in_epoch": 2, "seed": 0,
          "model": "TinyMLP", "config": {"lr": 0.1, "mode": mode}}
  manager.save(2, state, metadata=meta)
  restored, restored_meta = manager.restore(template)
  _assert_same_replicas(restored, state)
  assert restored_meta == {**meta, "epoch": 0}
  record = manager.read_metadata()
  assert (record["replica_count"], record["process_count"], record["local_device_count"]) == (
      topo.replica_count, topo.process_count, topo.local_device_count)
  stored_per_replica = {leaf["path"]: leaf["per_replica"] for leaf in record["leaves"]}
  assert stored_per_replica == differ


def test_restored_state_trains_on_like_the_original(topo, shared_dir):
  state, template = _states("topk")
  manager = CheckpointManager(shared_dir)
  manager.save(5, state, metadata={"step": 5})
  restored, _ = manager.restore(jax.eval_shape(lambda t: t, template))  # shapes suffice
  model = reference.TinyMLP()
  tx = jdist.dist_opt(optax.sgd(0.1, momentum=0.9), sparsify="topk:0.1")

  @jdist.data_parallel
  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: reference.loss_fn(model, p, x, y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  x, y = (reference.local_slices(a, topo, PER_REPLICA)
          for a in reference.global_batch(topo.replica_count, PER_REPLICA, seed=9))
  _assert_same_replicas(step(restored["params"], restored["opt_state"], x, y),
                        step(state["params"], state["opt_state"], x, y))


def test_equal_replicas_are_stored_once(topo, shared_dir):
  state, template = _states("plain")
  manager = CheckpointManager(shared_dir)
  manager.save(1, state)
  record = manager.read_metadata(1)
  assert not any(leaf["per_replica"] for leaf in record["leaves"])
  restored, meta = manager.restore(template, step=1)
  assert meta == {}
  _assert_same_replicas(restored, state)


def test_steps_keep_and_order(topo, shared_dir):
  state, template = _states("plain")
  manager = CheckpointManager(shared_dir, keep=2)
  assert manager.latest_step() is None
  for step in (1, 2, 3):
    manager.save(step, state, metadata={"step": step})
  assert manager.all_steps() == [2, 3]
  assert manager.latest_step() == 3
  assert manager.restore(template)[1] == {"step": 3}
  assert manager.restore(template, step=2)[1] == {"step": 2}
  with pytest.raises(errors.CheckpointError, match="No complete checkpoint of step 1.*"
                     r"complete steps: \[2, 3\]"):
    manager.restore(template, step=1)
  with pytest.raises(errors.CheckpointError, match=r"this very step"):
    manager.save(3, state)
  with pytest.raises(errors.CheckpointError, match="Steps must grow"):
    manager.save(2, state)


def test_save_leaves_no_threads_running(topo, shared_dir):
  state, _ = _states("plain")
  before = set(threading.enumerate())
  CheckpointManager(shared_dir).save(1, state)
  # orbax closes its event loop without joining the loop's thread, which may
  # take a moment to exit on a loaded machine; a thread still working after
  # the grace period is the bug this test is for.
  deadline = time.monotonic() + 10
  while set(threading.enumerate()) - before and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not set(threading.enumerate()) - before


def test_unfinished_write_is_ignored(topo, shared_dir):
  """What a writer killed mid-save leaves behind (cheap, in every topology)."""
  state, template = _states("plain")
  manager = CheckpointManager(shared_dir)
  manager.save(1, state, metadata={"step": 1})

  def half_written_step_2():
    partial = os.path.join(shared_dir, "2" + TMP_SUFFIX)
    shutil.copytree(os.path.join(shared_dir, "1"), partial)
    os.remove(os.path.join(partial, "commit_success.txt"))
    with open(os.path.join(partial, "jdist", "metadata"), "w") as f:
      f.write('{"format": "jdist-check')  # cut off mid-write

  _on_rank0(half_written_step_2)
  assert manager.latest_step() == 1
  assert manager.restore(template)[1] == {"step": 1}
  manager.save(2, state, metadata={"step": 2})
  assert manager.all_steps() == [1, 2]
  assert not [n for n in os.listdir(shared_dir) if TMP_SUFFIX in n]
  assert manager.restore(template)[1] == {"step": 2}


def test_fault_sigkill_during_save_keeps_previous_checkpoint(topo, shared_dir):
  """A writer SIGKILLed while writing step 2 leaves step 1 loadable."""
  partial = os.path.join(shared_dir, "2" + TMP_SUFFIX)

  def run_and_kill_writer():
    devices = topo.local_device_count if topo.process_count == 1 else 1
    writer = subprocess.Popen([sys.executable, WRITER, "kill", shared_dir], cwd=launch.REPO,
                              env=launch.clean_env(devices), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
      deadline = time.monotonic() + 120
      while not os.path.exists(partial):
        assert writer.poll() is None, f"writer ended early:\n{writer.stdout.read()}"
        assert time.monotonic() < deadline, "step 2's temporary directory never appeared"
        time.sleep(0.005)
      writer.send_signal(signal.SIGKILL)
      output = writer.communicate(timeout=30)[0]
    finally:
      if writer.poll() is None:
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL
    assert "SAVED 1" in output and "SAVED 2" not in output, output

  _on_rank0(run_and_kill_writer)
  assert os.path.isdir(partial)  # the killed write is still there...
  manager = CheckpointManager(shared_dir)
  assert manager.latest_step() == 1  # ...and ignored
  template = ckpt_writer.kill_state(0.0)
  state, meta = manager.restore(template)
  assert meta == {"step": 1}
  for replica in jdist.local_replicas(state):
    np.testing.assert_array_equal(replica["w"], np.ones(ckpt_writer.KILL_LEAF_SIZE))
  manager.save(2, ckpt_writer.kill_state(2.0), metadata={"step": 2})  # replaces it
  assert manager.all_steps() == [1, 2] and not os.path.exists(partial)
  assert manager.restore(template)[1] == {"step": 2}


def _other_replica_count() -> int:
  """A replica count unlike this job's: 3, or 5 where the job has 3."""
  return 5 if jdist.init().replica_count == 3 else 3


@pytest.fixture(scope="module")
def other_world():
  """Checkpoints written by a 1 process x `_other_replica_count()` devices job."""
  directory = tempfile.mkdtemp(prefix="jdist_ckpt_world_") if jdist.init().is_primary else None
  directory = host.allgather_object(directory)[0]
  count = _other_replica_count()

  def write():
    done = launch.python([WRITER, "world", directory], devices=count, timeout=120)
    assert done.returncode == 0 and f"WROTE {count} replicas" in done.stdout, (
        done.stdout + done.stderr[-3000:])

  _on_rank0(write)
  yield directory
  _on_rank0(lambda: shutil.rmtree(directory, ignore_errors=True))


def test_equal_replicas_reshard_into_another_world_size(topo, other_world, caplog):
  count = _other_replica_count()
  manager = CheckpointManager(os.path.join(other_world, "identical"))
  assert manager.read_metadata()["replica_count"] == count
  template = ckpt_writer.world_state(per_replica=False)
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jdist.checkpoint"):
    state, meta = manager.restore(jax.tree.map(np.zeros_like, template))
  assert meta == {"step": 7, "model": "dense"}
  _assert_same_replicas(state, template)
  if topo.is_primary:
    assert f"written by {count} replicas" in caplog.text and "replica 0's copy" in caplog.text


def test_per_replica_state_refuses_another_world_size(topo, other_world):
  count = _other_replica_count()
  manager = CheckpointManager(os.path.join(other_world, "per_replica"))
  template = ckpt_writer.world_state(per_replica=False)
  with pytest.raises(errors.CheckpointError) as caught:
    manager.restore(template)
  message = str(caught.value)
  assert f"written by {count} replicas (1 processes x {count} devices)" in message
  assert "opt_state" in message and "trace" in message  # names a per-replica leaf
  assert f"this run's {topo.replica_count} replicas" in message
  assert "jdist.sync_params" in message and f"Resume with {count} replicas" in message


def test_other_model_names_first_differing_leaf(topo, shared_dir):
  state, _ = _states("plain")
  manager = CheckpointManager(shared_dir)
  manager.save(1, state, metadata={"model": "TinyMLP"})
  devices = topo.local_device_count
  cnn = {"params": {"Conv_0": {"bias": np.zeros((devices, 8), np.float32),
                               "kernel": np.zeros((devices, 3, 3, 1, 8), np.float32)}}}
  with pytest.raises(errors.CheckpointError,
                     match=r"different state \(model 'TinyMLP'\): first difference at leaf "
                           r"#\d+: the checkpoint has \['params'\]\['params'\]\['Dense_0'\]"
                           r"\['bias'\] shape=\(32,\) dtype=float32, the template has "
                           r"\['params'\]\['params'\]\['Conv_0'\]"):
    manager.restore({"params": cnn, "opt_state": state["opt_state"]})
  wider = jax.tree.map(lambda x: np.zeros(x.shape[:-1] + (x.shape[-1] + 1,), x.dtype),
                       state["params"])
  with pytest.raises(errors.CheckpointError, match=r"shape=\(32,\).*shape=\(33,\)"):
    manager.restore({"params": wider, "opt_state": state["opt_state"]})


def test_missing_or_corrupt_checkpoints_name_the_path(topo, shared_dir):
  state, template = _states("plain")
  missing = os.path.join(shared_dir, "nothing-here")
  assert CheckpointManager(missing).latest_step() is None
  with pytest.raises(errors.CheckpointError, match=f"No checkpoint directory at {missing}"):
    CheckpointManager(missing).restore(template)
  _on_rank0(lambda: os.makedirs(missing))
  with pytest.raises(errors.CheckpointError, match=f"No complete checkpoint in {missing}"):
    CheckpointManager(missing).restore(template)

  manager = CheckpointManager(shared_dir)
  manager.save(1, state)
  manager.save(2, state)
  step1, step2 = (os.path.join(shared_dir, s) for s in ("1", "2"))

  def corrupt():
    with open(os.path.join(step1, "jdist", "metadata"), "w") as f:
      f.write("{not json")
    for root, _, files in os.walk(os.path.join(step2, "state")):
      for name in files:
        with open(os.path.join(root, name), "wb") as f:
          f.write(b"garbage")

  _on_rank0(corrupt)
  with pytest.raises(errors.CheckpointError, match=f"{step1} is not a readable jdist checkpoint"):
    manager.restore(template, step=1)
  with pytest.raises(errors.CheckpointError, match=f"{step2} could not be read"):
    manager.restore(template, step=2)


def test_bad_arguments_are_named(topo, shared_dir):
  state, _ = _states("plain")
  with pytest.raises(ValueError, match="keep=0"):
    CheckpointManager(shared_dir, keep=0)
  manager = CheckpointManager(shared_dir)
  with pytest.raises(errors.ShapeError, match="taken as the replicated layout of the "
                     "data_parallel style.*style='global' for a jit-style state"):
    manager.save(1, {"x": np.zeros(())}, style="replicated")
  with pytest.raises(errors.ShapeError, match=r"mixes the two styles: leaf \['dp'\].* is in "
                     r"the replicated layout.*leaf \['jit'\] is a global array of the jit"):
    manager.save(1, {"dp": state["params"], "jit": jax.numpy.zeros(())})
  with pytest.raises(ValueError, match="style='pmap'"):
    manager.save(1, state, style="pmap")
  with pytest.raises(ValueError, match="step=-1"):
    manager.save(-1, state)
  with pytest.raises(errors.CheckpointError, match="JSON-serializable"):
    manager.save(1, state, metadata={"when": object()})
  assert manager.latest_step() is None  # nothing was written


# The jit style: global arrays over jdist.mesh(), one copy per process ----------


def _processes_differ(tree):
  """Per leaf path: does any process hold another copy?"""
  _, mine = layout.host_copies(jax.tree.leaves(tree), layout.GLOBAL)
  everyone = host.allgather_object(mine)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  return {path: any(not np.array_equal(theirs[i], everyone[0][i]) for theirs in everyone)
          for i, path in enumerate(paths)}


def _jit_trained(topo, sparsify):
  """TinyMLP params and dist_opt(sgd) state after 2 jit steps, the README's way."""
  model = reference.TinyMLP()
  params = model.init(jax.random.key(0), reference.global_batch(1, 1)[0])
  tx = jdist.dist_opt(optax.sgd(0.1, momentum=0.9), **({"sparsify": sparsify} if sparsify
                                                       else {}))
  fresh = {"params": params, "opt_state": tx.init(params)}

  @jax.jit
  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: reference.loss_fn(model, p, x, y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  state = dict(fresh)
  with jax.set_mesh(jdist.mesh()):
    for seed in (1, 2):
      batch = jdist.shard_global_batch(reference.global_batch(topo.replica_count, PER_REPLICA,
                                                              seed=seed))
      state["params"], state["opt_state"] = step(state["params"], state["opt_state"], *batch)
  return state, fresh


@pytest.mark.parametrize("sparsify", [None, "topk:0.1"])
def test_jit_style_state_round_trips_bit_for_bit(topo, shared_dir, sparsify):
  state, fresh = _jit_trained(topo, sparsify)
  differ = _processes_differ(state)
  if sparsify and topo.process_count > 1:  # top-K's residuals are per process
    assert any(differ.values())
  manager = CheckpointManager(shared_dir)
  manager.save(2, state, metadata={"step": 2})
  restored, meta = manager.restore(fresh)  # a fresh state: host and one-device arrays
  assert meta == {"step": 2}
  _assert_same_replicas(restored, state)
  record = manager.read_metadata()
  assert (record["style"], record["copies"]) == ("global", topo.process_count)
  assert {leaf["path"]: leaf["per_replica"] for leaf in record["leaves"]} == differ


@pytest.mark.parametrize("sparsify", [None, "topk:0.1"])
def test_nnx_model_and_optimizer_round_trip_bit_for_bit(topo, shared_dir, sparsify):
  model, optimizer = nnx_job.nnx_objects(sparsify)
  nnx_job.train(model, optimizer, 2)
  state = nnx_job.nnx_state(model, optimizer)
  differ = _processes_differ(state)
  if topo.process_count > 1:  # BatchNorm's statistics see the process's rows only
    assert any(differ.values())
  manager = CheckpointManager(shared_dir)
  manager.save(2, state, metadata={"step": 2})
  fresh_model, fresh_optimizer = nnx_job.nnx_objects(sparsify)
  restored, meta = manager.restore(nnx_job.nnx_state(fresh_model, fresh_optimizer))
  assert meta == {"step": 2}
  _assert_same_replicas(restored, state)
  record = manager.read_metadata()
  assert (record["style"], record["copies"]) == ("global", topo.process_count)
  assert {leaf["path"]: leaf["per_replica"] for leaf in record["leaves"]} == differ
  # The restored objects train on exactly like the originals.
  nnx.update(fresh_model, restored["model"])
  nnx.update(fresh_optimizer, restored["optimizer"])
  nnx_job.train(model, optimizer, 1, seed=5)
  nnx_job.train(fresh_model, fresh_optimizer, 1, seed=5)
  _assert_same_replicas(nnx_job.nnx_state(fresh_model, fresh_optimizer),
                        nnx_job.nnx_state(model, optimizer))


@pytest.fixture(scope="module")
def other_world_nnx():
  """A jit-style NNX checkpoint written by a 1 process x `_other_replica_count()` job."""
  directory = tempfile.mkdtemp(prefix="jdist_ckpt_nnx_") if jdist.init().is_primary else None
  directory = host.allgather_object(directory)[0]
  count = _other_replica_count()

  def write():
    done = launch.python([GLOBAL_WRITER, directory], devices=count, timeout=180)
    assert done.returncode == 0 and f"WROTE {count} replicas" in done.stdout, (
        done.stdout + done.stderr[-3000:])

  _on_rank0(write)
  yield directory
  _on_rank0(lambda: shutil.rmtree(directory, ignore_errors=True))


def test_nnx_state_resumes_on_another_replica_count(topo, other_world_nnx, caplog):
  manager = CheckpointManager(os.path.join(other_world_nnx, "nnx"))
  record = manager.read_metadata()
  assert (record["replica_count"], record["style"]) == (_other_replica_count(), "global")
  model, optimizer = nnx_job.nnx_objects()
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="jdist.checkpoint"):
    restored, meta = manager.restore(nnx_job.nnx_state(model, optimizer))
  assert nnx_job.digest(restored) == meta["digest"]  # bit for bit the writer's state
  if topo.is_primary and topo.process_count > 1:
    assert "written in the global style by 1 x" in caplog.text
  nnx.update(model, restored["model"])
  nnx.update(optimizer, restored["optimizer"])
  nnx_job.train(model, optimizer, 1)  # and it trains on
  assert int(optimizer.step[...]) == 3


def test_a_data_parallel_checkpoint_restores_into_the_jit_style(topo, other_world):
  manager = CheckpointManager(os.path.join(other_world, "identical"))
  expected = jdist.unreplicate(ckpt_writer.world_state(per_replica=False))
  restored, _ = manager.restore(jax.tree.map(np.zeros_like, expected), style="global")
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(jdist.mesh(), jax.sharding.PartitionSpec()), a.ndim)
  with pytest.raises(errors.CheckpointError, match=r"written in the replicated style by \d+ "
                     r"replicas.*differ per copy.*in the global style"):
    CheckpointManager(os.path.join(other_world, "per_replica")).restore(
        jax.tree.map(np.zeros_like, expected), style="global")


def test_per_process_state_refuses_another_process_count(topo):
  record = {"replica_count": 4, "process_count": 4, "local_device_count": 1,
            "style": "global", "copies": topo.process_count + 2,
            "leaves": [{"path": "['model']['norm']['mean'].value", "per_replica": True}]}
  with pytest.raises(errors.CheckpointError, match=r"global style by \d+ processes.*"
                     r"\['norm'\]\['mean'\].*this run's \d+ processes"):
    layout.check_world("ckpt/3", record, topo, "global")
  record["leaves"][0]["per_replica"] = False
  layout.check_world("ckpt/3", record, topo, "global")  # equal copies: any count


# Written by jdist at 56e8bb9, before the feature-folder move (jdist/checkpoint.py ->
# jdist/checkpoint/manager.py), in 1 process x 4 devices (tests/data/README.md).
OLD_CHECKPOINT = os.path.join(os.path.dirname(__file__), "data", "checkpoint_56e8bb9")


def test_a_checkpoint_written_before_the_move_restores(topo):
  params = {"w": jax.numpy.zeros((2, 3)), "b": jax.numpy.zeros(3, jax.numpy.bfloat16)}
  tx = jdist.dist_opt(optax.sgd(0.1, momentum=0.9))
  template = {"params": jdist.replicate(params), "opt_state": jdist.replicate(tx.init(params)),
              "step": jdist.replicate(jax.numpy.int32(0))}
  state, metadata = CheckpointManager(OLD_CHECKPOINT).restore(template)
  assert metadata["epoch"] == 2 and "56e8bb9" in metadata["note"]
  for replica in range(topo.local_device_count):  # 4 equal copies saved, any count restored
    np.testing.assert_array_equal(np.asarray(state["params"]["w"][replica]),
                                  np.arange(6.0).reshape(2, 3))
    assert state["params"]["b"].dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(state["params"]["b"][replica], np.float32), 1.0)
    assert int(state["step"][replica]) == 7
