"""`jdist.shard` and `jdist.process_slice`: a global-batch pipeline, cut per replica."""

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist import errors
from tests import reference


def test_process_slice_then_shard_gives_each_replica_its_rows(topo):
  per_replica = 3
  x, y = reference.global_batch(topo.replica_count, per_replica)
  mine = jdist.shard(jdist.process_slice({"x": x, "y": y}))
  np.testing.assert_array_equal(mine["x"], reference.local_slices(x, topo, per_replica))
  np.testing.assert_array_equal(mine["y"], reference.local_slices(y, topo, per_replica))
  assert mine["x"].shape[:2] == (topo.local_device_count, per_replica)


def test_global_batch_pipeline_trains_like_one_device_on_the_whole_batch(topo):
  """What a user porting a script that loads the global batch on every process writes."""
  per_replica, steps = 4, 5
  model = reference.TinyMLP()
  batches = [reference.global_batch(topo.replica_count, per_replica, seed=s) for s in range(3)]
  params = model.init(jax.random.key(0), batches[0][0][:1])
  tx = jdist.dist_opt(optax.sgd(0.1, momentum=0.9))
  expected = reference.train_reference(model, params, optax.sgd(0.1, momentum=0.9), batches,
                                       steps)
  replicated = jdist.replicate(params)
  opt_state = jdist.data_parallel(tx.init)(replicated)
  step = jdist.data_parallel(reference.train_step_fn(model, tx))
  for i in range(steps):
    x, y = jdist.shard(jdist.process_slice(batches[i % len(batches)]))
    replicated, opt_state = step(replicated, opt_state, x, y)
  reference.assert_trees_close(jdist.unreplicate(replicated), expected)


def test_shard_defaults_to_the_local_device_count(topo):
  batch = {"x": np.arange(topo.local_device_count * 6.0).reshape(-1, 2)}
  assert jdist.shard(batch)["x"].shape == (topo.local_device_count, 3, 2)


def test_bad_global_batches_name_the_sizes(topo):
  with pytest.raises(errors.ShapeError, match=f"not divisible by {topo.replica_count} replicas"):
    jdist.process_slice({"x": np.zeros((topo.replica_count * 2 + 1, 2))})
  with pytest.raises(errors.ShapeError, match="same leading batch dimension"):
    jdist.process_slice({"x": np.zeros((8, 2)), "y": np.zeros(4)})
  with pytest.raises(ValueError, match="local_device_count=0"):
    jdist.shard({"x": np.zeros((4, 2))}, 0)
