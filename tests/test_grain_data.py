"""jdist.data.grain: grain shard options from the topology, batches that train like
one device on the global batch, and iterator positions kept in checkpoints.

Runs in all three topologies (1x4, 2x1, 2x2); the other processes' batches
are rebuilt locally from their shard options (`_host_batches`), so each
process checks the whole global batch against a single-device reference.
"""

import dataclasses
import os
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist import errors
from jdist.data import grain as grain_data
from jdist.checkpoint.manager import CheckpointManager
from jdist.data.grain import GrainLoader
from jdist.runtime import host
from tests import launch
from tests import reference

NUM_EXAMPLES = 64
GLOBAL_BATCH = 8  # a multiple of every topology's replica count (4, 2, 4)
STEPS = 3  # before the checkpoint: mid-epoch (8 steps make an epoch)
TRAIN_STEPS = 2


def _arrays(num_examples=NUM_EXAMPLES):
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(num_examples, 4, 4, 1)).astype(np.float32),
          "y": rng.integers(0, 10, size=num_examples).astype(np.int32),
          "id": np.arange(num_examples)}


def _as_process(topo, process_index, process_count=None):
  """The topology process `process_index` of `process_count` would have (host-side only)."""
  return dataclasses.replace(topo, process_index=process_index,
                             process_count=process_count or topo.process_count)


def _host_batches(arrays, topo, process_index, steps, process_count=None, **kwargs):
  """The first `steps` host batches process `process_index` reads."""
  loader = GrainLoader(arrays, global_batch_size=GLOBAL_BATCH,
                       topology=_as_process(topo, process_index, process_count), **kwargs)
  iterator = iter(loader.data_loader)
  return [next(iterator) for _ in range(steps)]


@pytest.fixture
def shared_dir():
  path = tempfile.mkdtemp(prefix="jdist_grain_") if jdist.init().is_primary else None
  path = host.allgather_object(path)[0]
  yield path
  if jdist.init().is_primary:
    shutil.rmtree(path, ignore_errors=True)


def test_shard_options_are_the_topology_and_jax_processes(topo):
  options = jdist.grain_shard_options()
  assert (options.shard_index, options.shard_count, options.drop_remainder) == (
      topo.process_index, topo.process_count, True)
  assert (options.shard_index, options.shard_count) == (jax.process_index(),
                                                        jax.process_count())
  assert not jdist.grain_shard_options(topo, drop_remainder=False).drop_remainder


@pytest.mark.parametrize("process_count, num_examples", [(1, 64), (2, 64), (3, 64), (2, 53)])
def test_an_epoch_reads_every_example_once_across_processes(topo, process_count,
                                                            num_examples):
  arrays = _arrays(num_examples)
  read = []
  for p in range(process_count):
    loader = GrainLoader(arrays, global_batch_size=GLOBAL_BATCH // 2 * process_count,
                         topology=_as_process(topo, p, process_count), num_epochs=1,
                         style="global")
    ids = [batch["id"] for batch in loader.data_loader]
    assert len(ids) == loader.steps_per_epoch  # the same step count on every process
    read.append(np.concatenate(ids))
  everything = np.concatenate(read)
  assert len(set(everything.tolist())) == len(everything)  # no example twice
  # Only the documented remainders go unread: the shard split's, then the batch's.
  shard = num_examples // process_count
  assert len(everything) == process_count * (shard - shard % (GLOBAL_BATCH // 2))


def test_processes_really_read_their_own_shards(topo):
  arrays = _arrays()
  loader = GrainLoader(arrays, global_batch_size=GLOBAL_BATCH, num_epochs=1)
  mine = np.concatenate([batch["id"] for batch in loader.data_loader])
  everyone = host.allgather_object(mine.tolist())
  assert sorted(sum(everyone, [])) == list(range(NUM_EXAMPLES))


def _jit_train(model, params, loader):
  tx = jdist.dist_opt(optax.sgd(0.1))
  step = jax.jit(reference.train_step_fn(model, tx))
  opt_state = tx.init(params)
  iterator = iter(loader)
  with jax.set_mesh(jdist.mesh()):
    for _ in range(TRAIN_STEPS):
      batch = next(iterator)
      params, opt_state = step(params, opt_state, batch["x"], batch["y"])
  iterator.close()
  return [jax.tree.map(lambda leaf: np.asarray(leaf.addressable_data(0)), params)]


def _data_parallel_train(model, params, loader):
  tx = jdist.dist_opt(optax.sgd(0.1))
  replicated = jdist.replicate(params)
  opt_state = jdist.data_parallel(tx.init)(replicated)
  step = jdist.data_parallel(reference.train_step_fn(model, tx))
  iterator = iter(loader)
  for _ in range(TRAIN_STEPS):
    batch = next(iterator)
    replicated, opt_state = step(replicated, opt_state, batch["x"], batch["y"])
  iterator.close()
  return [jax.tree.map(lambda leaf, d=d: np.asarray(leaf)[d], replicated)
          for d in range(loader.topology.local_device_count)]


def test_training_on_grain_batches_matches_one_device_on_the_global_batch(topo):
  arrays = _arrays()
  model = reference.TinyMLP()
  params = model.init(jax.random.key(0), arrays["x"][:1])
  per_process = [_host_batches(arrays, topo, p, TRAIN_STEPS, seed=3)
                 for p in range(topo.process_count)]
  global_batches = [(np.concatenate([batches[i]["x"] for batches in per_process]),
                     np.concatenate([batches[i]["y"] for batches in per_process]))
                    for i in range(TRAIN_STEPS)]
  expected = reference.train_reference(model, params, optax.sgd(0.1), global_batches,
                                       TRAIN_STEPS)
  for style, train in (("global", _jit_train), ("replicated", _data_parallel_train)):
    loader = GrainLoader(arrays, global_batch_size=GLOBAL_BATCH, seed=3, style=style)
    for copy in train(model, params, loader):
      reference.assert_trees_close(copy, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["global", "replicated"])
def test_checkpoint_resumes_the_iterator_at_the_exact_next_batch(topo, shared_dir, style):
  arrays = _arrays()
  state = {"w": jnp.arange(3.0)}
  iterator = iter(GrainLoader(arrays, global_batch_size=GLOBAL_BATCH, seed=5, style=style))
  for _ in range(STEPS):
    next(iterator)
  manager = CheckpointManager(shared_dir)
  manager.save(STEPS, state, data_iterator=iterator, style="global")
  following = [_local_rows(next(iterator)) for _ in range(6)]  # crosses the epoch's end
  iterator.close()
  fresh = iter(GrainLoader(arrays, global_batch_size=GLOBAL_BATCH, seed=5, style=style))
  restored, _ = manager.restore(state, data_iterator=fresh, style="global")
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(3.0))
  resumed = [_local_rows(next(fresh)) for _ in range(6)]
  fresh.close()
  np.testing.assert_array_equal(np.stack(resumed), np.stack(following))
  assert len(manager.read_metadata()["data_iterators"]) == topo.process_count


def _local_rows(batch):
  """This process's example ids of a placed batch, in row order."""
  return np.concatenate([np.asarray(shard.data).ravel()
                         for shard in sorted(batch["id"].addressable_shards,
                                             key=lambda s: s.index[0].start or 0)])


def test_restoring_a_position_that_was_not_saved_says_so(topo, shared_dir):
  manager = CheckpointManager(shared_dir)
  state = {"w": jnp.arange(3.0)}
  manager.save(1, state, style="global")
  fresh = iter(GrainLoader(_arrays(), global_batch_size=GLOBAL_BATCH))
  with pytest.raises(errors.CheckpointError, match="saved without data_iterator="):
    manager.restore(state, data_iterator=fresh, style="global")
  with pytest.raises(ValueError, match="needs get_state"):
    manager.save(2, state, data_iterator=object(), style="global")
  fresh.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"global_batch_size": 6}, "global_batch_size=6 is not divisible"),
    ({"global_batch_size": 8, "style": "pmap"}, "style='pmap'"),
    ({"global_batch_size": 128}, "use a smaller global_batch_size"),
    ({"global_batch_size": 8, "num_epochs": 0}, "num_epochs"),
])
def test_bad_arguments_are_named(kwargs, match):
  topology = jdist.Topology(0, 2, 2)
  with pytest.raises(ValueError, match=match):
    GrainLoader(_arrays(), topology=topology, **kwargs)
  with pytest.raises(ValueError, match="leading"):
    GrainLoader({"x": np.zeros(8), "y": np.zeros(9)}, global_batch_size=8, topology=topology)


def test_a_missing_grain_says_how_to_install_it(monkeypatch):
  monkeypatch.setitem(sys.modules, "grain", None)
  with pytest.raises(ImportError, match=r"pip install 'jdist\[data\]'"):
    jdist.grain_shard_options()


def test_mnist_grain_example_stops_and_resumes_subprocess(tmp_path):
  """examples/mnist_grain.py as a user runs it: interrupted mid-epoch, then resumed."""
  example = [os.path.join(launch.REPO, "examples", "mnist_grain.py"), "--dataset", "digits",
             "--epochs", "1", "--checkpoint-dir", str(tmp_path)]
  first = launch.python(example + ["--stop-at-step", "8"], devices=4, timeout=240)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "stopped at step 8:" in first.stdout
  second = launch.python(example, devices=4, timeout=240)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "resumed at step 8" in second.stdout
  assert "epoch 1/1:" in second.stdout and "stopped at step 22:" in second.stdout
