"""qsgd: 8-bit stochastic levels on the wire, against the replicas emulated on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.compression import qsgd as qsgd_lib
from tests import reference

BUCKET = 64
SHAPES = {"w": (12, 11), "b": (7,)}  # 139 entries: 3 buckets of 64, the last padded
STEPS = 3


def _every_replica_grads(topo, step):
  return reference.every_replica_grads(topo, SHAPES, seed=100 + step)


def _emulated(every_steps, replicas, seed, error_feedback):
  """The algorithm in numpy, one replica after another: (averages, residuals) per step."""
  size = sum(int(np.prod(shape)) for shape in SHAPES.values())
  padded = -(-size // BUCKET) * BUCKET
  residuals = np.zeros((replicas, padded), np.float32)
  averages = []
  for step, every in enumerate(every_steps):
    total = np.zeros(padded, np.float32)
    for r in range(replicas):
      flat = np.concatenate([every[name][r].reshape(-1) for name in ("b", "w")])
      x = np.pad(flat, (0, padded - size)) + (residuals[r] if error_feedback else 0)
      rows = x.reshape(-1, BUCKET)
      scales = np.abs(rows).max(axis=1)
      safe = np.where(scales > 0, scales, np.float32(1))[:, None]
      level = np.abs(rows) / safe * np.float32(127)
      u = np.asarray(jax.random.uniform(qsgd_lib.step_key(seed, step, r), rows.shape))
      q = np.sign(rows) * (np.floor(level) + (u < level - np.floor(level)))
      assert np.abs(q).max() <= 127
      decoded = (q.astype(np.float32) * (scales[:, None] / np.float32(127))).reshape(-1)
      if error_feedback:
        residuals[r] = x - decoded
      total += decoded
    averages.append(total[:size] / replicas)
  return averages, residuals


@pytest.mark.parametrize("error_feedback", [True, False])
def test_qsgd_matches_the_replicas_emulated_on_one_device(topo, error_feedback):
  tx = optax.chain(jdist.qsgd(BUCKET, error_feedback=error_feedback, seed=3), jdist.allreduce())
  every_steps = [_every_replica_grads(topo, step) for step in range(STEPS)]
  step = jdist.data_parallel(tx.update)
  state = jdist.data_parallel(tx.init)(reference.local_rows(every_steps[0], topo))
  averages, residuals = _emulated(every_steps, topo.replica_count, 3, error_feedback)
  for every, expected in zip(every_steps, averages):
    out, state = step(reference.local_rows(every, topo), state)
    got = np.concatenate([np.asarray(out["b"]).reshape(topo.local_device_count, -1),
                          np.asarray(out["w"]).reshape(topo.local_device_count, -1)], axis=1)
    # Float32 rounding differs by a few ulps of the bucket scales (up to 30
    # here: XLA rounds scale / 127 and the sums its own way); one level rounded
    # the other way would be off by a whole step, scale / 127 > 1e-3 here.
    for replica in got:  # every local replica holds the same average
      np.testing.assert_allclose(replica, expected, rtol=0, atol=2e-5)
  if error_feedback:
    np.testing.assert_allclose(np.asarray(state[0].residual),
                               residuals[list(topo.replica_indices)], rtol=0, atol=2e-5)


def test_stochastic_rounding_is_unbiased():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(256,)).astype(np.float32))
  trials = 400
  keys = jax.random.split(jax.random.key(7), trials)
  decode = jax.jit(jax.vmap(lambda key: qsgd_lib.dequantize(*qsgd_lib.quantize(x, key, BUCKET),
                                                            BUCKET)))
  decoded = np.asarray(decode(keys))
  scales = np.repeat(np.abs(np.asarray(x)).reshape(-1, BUCKET).max(1), BUCKET)
  step = scales / 127
  assert np.all(np.abs(decoded - np.asarray(x)) <= step * (1 + 1e-6))  # one level at most
  # Each draw is x's lower or upper level: variance <= step^2 / 4, so the
  # mean of `trials` draws is within 6 sigma of x unless the rounding is biased.
  bound = 6 * step / (2 * np.sqrt(trials)) + 1e-7
  np.testing.assert_array_less(np.abs(decoded.mean(0) - np.asarray(x)), bound)
  # The bound can fail: rounding down (biased) is off by more than it.
  floored = np.floor(np.abs(np.asarray(x)) / step) * step * np.sign(np.asarray(x))
  assert np.abs(floored - np.asarray(x)).max() > bound.max()


def test_the_wire_carries_8_bit_levels_and_a_scale_per_bucket(topo):
  every = _every_replica_grads(topo, 0)
  size = sum(int(np.prod(shape)) for shape in SHAPES.values())
  buckets = -(-size // BUCKET)

  def sent(tx):
    return reference.wire_bytes_of(tx, reference.local_rows(every, topo))

  quantized = sent(optax.chain(jdist.qsgd(BUCKET), jdist.allreduce()))
  dense = sent(jdist.allreduce())
  processes, devices = topo.process_count, topo.local_device_count
  # An all-gather of (levels: 1 byte per padded entry | scales: 4 bytes per bucket).
  assert quantized == (processes - 1) * devices * (buckets * BUCKET + 4 * buckets)
  assert dense == pytest.approx(2 * (processes - 1) / processes * size * 4)
  payload, _ = jdist.qsgd(BUCKET).update(jax.tree.map(lambda x: x[0], every),
                                        jdist.qsgd(BUCKET).init(jax.tree.map(lambda x: x[0],
                                                                             every)))
  assert payload.levels.dtype == jnp.int8 and payload.scales.dtype == jnp.float32


def test_dist_opt_qsgd_is_the_chain_and_trains_like_one_device(topo):
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(5), x0)
  batches = [reference.global_batch(topo.replica_count, 4, seed=s) for s in range(2)]
  inner = optax.sgd(0.05, momentum=0.9)
  by_keyword, _ = reference.train_jdist(model, params, jdist.dist_opt(inner, qsgd=True),
                                        batches, 6, topo, 4)
  by_chain, _ = reference.train_jdist(
      model, params, optax.chain(jdist.qsgd(), jdist.allreduce(), inner), batches, 6, topo, 4)
  reference.assert_trees_close(by_keyword, by_chain, rtol=0, atol=0)
  # 8 bits with error feedback stays near full precision on one device.
  expected = reference.train_reference(model, params, inner, batches, 6)
  reference.assert_trees_close(jdist.unreplicate(by_keyword), expected, rtol=0.05, atol=2e-3)


def test_qsgd_combines_with_no_other_gradient_scheme():
  for other in ({"half": True}, {"sparsify": "topk:0.1"}, {"powersgd": 2}, {"partial": 2},
                {"diloco": 4}, {"local_sgd": 4}):
    with pytest.raises(ValueError, match="cannot be combined"):
      jdist.dist_opt(optax.sgd(0.1), qsgd=True, **other)
  with pytest.raises(ValueError, match="bucket_size=0"):
    jdist.dist_opt(optax.sgd(0.1), qsgd=0)
  with pytest.raises(ValueError, match="threshold_capacity=0.1 only applies"):
    jdist.dist_opt(optax.sgd(0.1), qsgd=True, threshold_capacity=0.1)
  with pytest.raises(ValueError, match="jdist.cast cannot follow QSGDPayload"):
    tx = optax.chain(jdist.qsgd(), jdist.cast())
    tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}))
