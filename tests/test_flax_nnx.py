"""`jdist.SyncBatchNorm` and replica-aware keys, against one device on the whole batch."""

import jax
import numpy as np
from flax import nnx

import jdist

PER_REPLICA = 3
FEATURES = 5


def _global_batch(topo):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(topo.replica_count * PER_REPLICA, FEATURES)) * 3 + 1).astype(
      np.float32)


def _reference(x):
  """nnx.BatchNorm on one device over the whole batch: outputs and running stats."""
  norm = nnx.BatchNorm(FEATURES, rngs=nnx.Rngs(0))
  out = norm(x)
  return np.asarray(out), np.asarray(norm.mean[...]), np.asarray(norm.var[...])


def test_sync_batchnorm_in_a_global_step_matches_one_device(topo):
  x = _global_batch(topo)
  expected, mean, var = _reference(x)
  norm = jdist.SyncBatchNorm(FEATURES)

  @nnx.jit
  def forward(module, batch):
    return module(batch)

  with jax.set_mesh(jdist.mesh()):
    out = forward(norm, jdist.shard_global_batch(x))
  np.testing.assert_allclose(np.asarray(out), jdist.process_slice(expected), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(norm.mean[...]), mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(norm.var[...]), var, rtol=1e-5, atol=1e-6)


def test_sync_batchnorm_in_a_data_parallel_step_matches_one_device(topo):
  x = _global_batch(topo)
  expected, mean, var = _reference(x)
  graphdef, state = nnx.split(jdist.SyncBatchNorm(FEATURES))

  @jdist.data_parallel
  def forward(state, batch):
    module = nnx.merge(graphdef, state)
    return module(batch), nnx.state(module)

  out, new_state = forward(jdist.replicate(state), jdist.shard(jdist.process_slice(x)))
  np.testing.assert_allclose(np.asarray(out).reshape(-1, FEATURES), jdist.process_slice(expected),
                             rtol=1e-5, atol=1e-5)
  for replica in jdist.local_replicas(new_state):  # identical on every replica
    np.testing.assert_allclose(np.asarray(replica["mean"][...]), mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(replica["var"][...]), var, rtol=1e-5, atol=1e-6)


def test_eval_mode_uses_the_running_statistics(topo):
  del topo
  norm = jdist.SyncBatchNorm(FEATURES)
  norm.eval()
  x = np.full((4, FEATURES), 2.0, np.float32)
  np.testing.assert_allclose(np.asarray(norm(x)), x / np.sqrt(1 + 1e-5), rtol=1e-6)


def test_replica_keys_differ_per_replica_and_agree_with_replica_index(topo):
  key = jax.random.key(7)

  @jdist.data_parallel(in_axes=None)
  def draw(k):
    return jax.random.uniform(jdist.replica_key(k)), jdist.replica_index()

  values, indices = draw(key)
  np.testing.assert_array_equal(np.asarray(indices), np.asarray(topo.replica_indices))
  everyone = jdist.host_allreduce(_scatter(topo, np.asarray(values)))
  assert len(set(np.round(everyone, 7))) == topo.replica_count
  assert jdist.replica_index() == topo.process_index  # on the host: this process


def _scatter(topo, values):
  out = np.zeros(topo.replica_count, np.float64)
  out[list(topo.replica_indices)] = values
  return out


def _regression(topo, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(topo.replica_count * PER_REPLICA, FEATURES)).astype(np.float32)
  return x, (x.sum(axis=1, keepdims=True) * 0.5).astype(np.float32)


def _mse(model, x, y):
  return ((model(x) - y) ** 2).mean()


def test_nnx_data_parallel_trains_objects_like_one_device(topo):
  import optax  # pylint: disable=g-import-not-at-top
  reference = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(0))
  ref_optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
  model = nnx.Linear(FEATURES, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jdist.dist_opt(optax.sgd(0.1)), wrt=nnx.Param)

  @nnx.jit
  def ref_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_mse)(model, x, y)
    optimizer.update(model, grads)
    return loss

  @jdist.nnx_data_parallel(out_axes=(None, 0))
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_mse)(model, x, y)
    optimizer.update(model, grads)
    return jdist.pmean(loss), jdist.replica_index()

  for seed in range(3):
    x, y = _regression(topo, seed)
    expected = ref_step(reference, ref_optimizer, x, y)
    loss, replicas = step(model, optimizer, *jdist.shard(jdist.process_slice((x, y))))
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(replicas), topo.replica_indices)
  # The objects hold a copy per local device, each equal to one device's.
  kernel = np.asarray(model.kernel[...])
  assert kernel.shape == (topo.local_device_count, FEATURES, 1)
  for copy in kernel:
    np.testing.assert_allclose(copy, np.asarray(reference.kernel[...]), rtol=1e-5, atol=1e-6)
  assert np.asarray(optimizer.step[...]).tolist() == [3] * topo.local_device_count
  np.testing.assert_allclose(jdist.replica_mean(optimizer.step[...]), 3.0)
