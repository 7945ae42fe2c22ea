"""cast / topk / threshold: what they send, what comes back, what is kept."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.compression import half
from jdist.compression import protocol
from jdist.compression import sparse
from tests import reference

PER_REPLICA = 4


def _replica_grads(topo, shape=(64, 33), seed=0, scale=1.0):
  """Different gradients on every replica: [local_devices, *shape]."""
  rng = np.random.default_rng(seed)
  every = rng.normal(size=(topo.replica_count,) + shape).astype(np.float32) * scale
  return {"w": every[list(topo.replica_indices)], "b": every[list(topo.replica_indices), 0]}, every


def _reduce(tx, grads):
  @jdist.data_parallel
  def step(g):
    state = tx.init(g)
    out, state = tx.update(g, state)
    return out, jdist.wire_bytes(state)
  return step(grads)


@pytest.mark.parametrize("dtype, rtol", [(jnp.float16, 2e-3), (jnp.bfloat16, 2e-2)])
def test_cast_matches_float32_average_within_16bit_tolerance(topo, dtype, rtol):
  grads, every = _replica_grads(topo)
  dense, dense_bytes = _reduce(jdist.allreduce(), grads)
  half, half_bytes = _reduce(optax.chain(jdist.cast(dtype), jdist.allreduce()), grads)
  assert half["w"].dtype == jnp.float32  # back in the gradients' own dtype
  np.testing.assert_allclose(dense["w"][0], every.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(half["w"][0], every.mean(0), rtol=rtol, atol=rtol)
  if topo.process_count > 1:
    np.testing.assert_allclose(half_bytes[0], dense_bytes[0] / 2, rtol=0.01)
  else:
    assert dense_bytes[0] == 0 and half_bytes[0] == 0


def test_cast_sum_mode_and_no_overflow(topo):
  # 60000 * R overflows float16 unless values are pre-divided.
  grads = {"w": np.full((topo.local_device_count, 8), 60000.0, np.float32)}
  summed, _ = _reduce(optax.chain(jdist.cast(jnp.float16), jdist.allreduce(mean=False)), grads)
  np.testing.assert_allclose(summed["w"], 60000.0 * topo.replica_count, rtol=1e-3)
  mean, _ = _reduce(optax.chain(jdist.cast(jnp.float16), jdist.allreduce()), grads)
  assert np.isfinite(mean["w"]).all()


def test_topk_full_ratio_equals_dense_average(topo):
  grads, every = _replica_grads(topo)
  dense, _ = _reduce(jdist.allreduce(), grads)
  sparse, _ = _reduce(optax.chain(jdist.topk(1.0), jdist.allreduce()), grads)
  np.testing.assert_allclose(sparse["w"], dense["w"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(sparse["b"], dense["b"], rtol=1e-6, atol=1e-7)


def _local_send_log(tx, grad_steps):
  """Runs a compressor alone; returns what each step sent (dense) and the state."""

  @jdist.data_parallel
  def step(g, state):
    payload, state = tx.update(g, state)
    sent = jnp.zeros(payload.ctx.spec.size).at[payload.indices].add(
        payload.values.astype(jnp.float32) / payload.ctx.scale)
    return sent, state

  state = jdist.data_parallel(tx.init)(grad_steps[0])
  sent_total = 0.0
  for g in grad_steps:
    sent, state = step(g, state)
    sent_total = sent_total + np.asarray(sent)
  return sent_total, state


@pytest.mark.parametrize("make_tx", [lambda: jdist.topk(0.05),
                                     lambda: jdist.topk(0.05, method="block"),
                                     lambda: jdist.threshold(0.5, capacity=40)],
                         ids=["topk", "topk-block", "threshold-overflowing"])
def test_error_feedback_loses_nothing(topo, make_tx):
  steps = [_replica_grads(topo, shape=(20, 10), seed=s)[0] for s in range(6)]
  sent_total, state = _local_send_log(make_tx(), steps)
  grad_total = sum(np.concatenate([np.asarray(g["b"]), np.asarray(g["w"]).reshape(
      topo.local_device_count, -1)], axis=1) for g in steps)
  # Leaf order in the flat vector is b then w (sorted dict keys).
  np.testing.assert_allclose(sent_total + np.asarray(state.residual), grad_total,
                             rtol=1e-5, atol=1e-5)
  assert (np.asarray(state.sent) > 0).all()


def _dgc_reference(replica_steps, ratio, momentum):
  """Deep Gradient Compression in numpy, one replica at a time: the average
  of what every replica sends, per step."""
  replicas, size = replica_steps[0].shape
  count = int(np.ceil(ratio * size))
  velocity = np.zeros((replicas, size))
  residual = np.zeros((replicas, size))
  averages = []
  for grads in replica_steps:
    sent = np.zeros((replicas, size))
    for r in range(replicas):
      velocity[r] = momentum * velocity[r] + grads[r]
      residual[r] += velocity[r]
      chosen = np.argsort(-np.abs(residual[r]))[:count]
      sent[r, chosen] = residual[r, chosen]
      residual[r, chosen] = 0.0
      velocity[r, chosen] = 0.0
    averages.append(sent.mean(0))
  return averages


def test_topk_momentum_correction_matches_dgc_reference(topo):
  rng = np.random.default_rng(3)
  steps = [rng.normal(size=(topo.replica_count, 50)).astype(np.float32) for _ in range(5)]
  expected = _dgc_reference(steps, 0.1, 0.9)
  tx = optax.chain(jdist.topk(0.1, momentum=0.9), jdist.allreduce())

  @jdist.data_parallel
  def step(g, state):
    return tx.update(g, state)

  mine = list(topo.replica_indices)
  state = jdist.data_parallel(tx.init)({"w": steps[0][mine]})
  for grads, want in zip(steps, expected):
    out, state = step({"w": grads[mine]}, state)
    np.testing.assert_allclose(np.asarray(out["w"]), np.broadcast_to(want, out["w"].shape),
                               rtol=1e-5, atol=1e-6)


def test_block_topk_takes_each_blocks_largest_entry():
  x = jnp.array([0.1, -3.0, 0.2, 0.5, 0.4, -0.1, 2.0, 0.0, 1.0, -1.5])
  indices = sparse._block_maxima(x, 4)  # blocks of 3: [0:3] [3:6] [6:9] [9:10]
  np.testing.assert_array_equal(indices, [1, 3, 6, 9])
  full = sparse._block_maxima(x, 10)
  np.testing.assert_array_equal(full, np.arange(10))


def test_threshold_counts_overflow_and_sends_at_most_capacity(topo):
  grads, _ = _replica_grads(topo, shape=(20, 10), seed=1)
  tx = jdist.threshold(0.1, capacity=16)
  _, state = _local_send_log(tx, [grads])
  assert (np.asarray(state.sent) == 16).all()
  assert (np.asarray(state.overflow) > 0).all()
  without_feedback = jdist.threshold(0.1, error_feedback=False, capacity=16)
  _, state = _local_send_log(without_feedback, [grads])
  assert state.residual.shape[-1] == 0


def test_topk_with_fp16_values_trains_close_to_dense(topo):
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(0), x0)
  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=s) for s in range(2)]
  expected = reference.train_reference(model, params, optax.sgd(0.05), batches, 5)
  tx = jdist.dist_opt(optax.sgd(0.05), sparsify="topk:1.0", half=True)
  replicated, _ = reference.train_jdist(model, params, tx, batches, 5, topo, PER_REPLICA)
  reference.assert_trees_close(jdist.unreplicate(replicated), expected, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("inner", [optax.sgd(0.05, momentum=0.9), optax.adam(1e-3),
                                   optax.adamw(1e-3)], ids=["sgd", "adam", "adamw"])
@pytest.mark.parametrize("mode", ["half", "topk", "threshold"])
def test_compressors_compose_with_optimizers_and_multisteps(topo, inner, mode):
  kwargs = {"half": {"half": jnp.bfloat16}, "topk": {"sparsify": "topk:0.1"},
            "threshold": {"sparsify": "threshold:0.01"}}[mode]
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(0), x0)
  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=s) for s in range(2)]
  tx = optax.MultiSteps(jdist.dist_opt(inner, **kwargs), every_k_schedule=2)
  replicated, _ = reference.train_jdist(model, params, tx, batches, 4, topo, PER_REPLICA)
  replicas = jdist.local_replicas(replicated)
  # Averaged updates keep every replica identical, and training moved them.
  for replica in replicas[1:]:
    reference.assert_trees_close(replica, replicas[0], rtol=0, atol=0)
  moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), replicas[0], params)
  assert max(jax.tree.leaves(moved)) > 0


def test_topk_one_percent_sends_one_percent_per_process_of_dense_bytes(topo):
  size = 1 << 20  # a 1M-parameter gradient
  grads = {"w": np.random.default_rng(0).normal(
      size=(topo.local_device_count, size)).astype(np.float32)}
  _, dense_bytes = _reduce(jdist.allreduce(), grads)
  _, sparse_bytes = _reduce(optax.chain(jdist.topk(0.01), jdist.allreduce()), grads)
  _, half_sparse = _reduce(optax.chain(jdist.topk(0.01), jdist.cast(jnp.float16),
                                       jdist.allreduce()), grads)
  processes, devices = topo.process_count, topo.local_device_count
  k = int(np.ceil(0.01 * size))
  # What the counter reports is the algorithm's real traffic: an all-gather of
  # k (value, index) pairs per local device against a ring all-reduce.
  assert sparse_bytes[0] == (processes - 1) * devices * k * 8
  assert half_sparse[0] == (processes - 1) * devices * k * 6
  assert dense_bytes[0] == pytest.approx(2 * (processes - 1) / processes * size * 4)
  if processes > 1 and devices == 1:
    # The gather grows with the processes, the ring does not: 1% x P of it.
    assert sparse_bytes[0] <= 0.0101 * processes * dense_bytes[0]


@pytest.mark.parametrize("name, dtype", [("fp16", jnp.float16), ("bf16", jnp.bfloat16),
                                         ("float16", jnp.float16), ("bfloat16", jnp.bfloat16)])
def test_half_takes_the_clis_names_as_well_as_dtypes(topo, name, dtype):
  """dist_opt(half="bf16") is dist_opt(half=jnp.bfloat16), bit for bit."""
  grads, _ = _replica_grads(topo, shape=(8, 5))
  by_name = jdist.dist_opt(optax.sgd(0.1), half=name)
  by_dtype = jdist.dist_opt(optax.sgd(0.1), half=dtype)
  np.testing.assert_array_equal(_reduce(by_name, grads)[0]["w"], _reduce(by_dtype, grads)[0]["w"])
  cast = _reduce(optax.chain(jdist.cast(name), jdist.allreduce()), grads)[0]["w"]
  np.testing.assert_array_equal(
      cast, _reduce(optax.chain(jdist.cast(dtype), jdist.allreduce()), grads)[0]["w"])


@pytest.mark.parametrize("half", ["bf8", "float32", jnp.float32, 16, "int16"])
def test_a_bad_half_is_named_as_given(half):
  with pytest.raises(ValueError, match=r"half=.* is not a 16-bit float") as info:
    jdist.dist_opt(optax.sgd(0.1), half=half)
  assert f"half={half!r}" in str(info.value)
  assert "'fp16', 'float16', 'bf16', 'bfloat16'" in str(info.value)


def test_compressor_arguments_are_checked():
  with pytest.raises(ValueError, match="16-bit float"):
    jdist.cast(jnp.float32)
  with pytest.raises(ValueError, match="ratio=0"):
    jdist.topk(0)
  with pytest.raises(ValueError, match="ratio=1.5"):
    jdist.topk(1.5)
  with pytest.raises(ValueError, match="method='fast'"):
    jdist.topk(0.1, method="fast")
  with pytest.raises(ValueError, match="value=-1"):
    jdist.threshold(-1)
  with pytest.raises(ValueError, match="capacity=0"):
    jdist.threshold(0.1, capacity=0)
  with pytest.raises(ValueError, match="capacity=2.0"):
    jdist.threshold(0.1, capacity=2.0)
  with pytest.raises(ValueError, match="momentum=1.0"):
    jdist.topk(0.1, momentum=1.0)
  with pytest.raises(ValueError, match="needs error_feedback=True"):
    jdist.threshold(0.1, error_feedback=False, momentum=0.9)


def test_payload_order_is_checked(topo):
  grads, _ = _replica_grads(topo)
  with pytest.raises(ValueError, match="must come before jdist.cast"):
    _reduce(optax.chain(jdist.cast(jnp.float16), jdist.topk(0.1), jdist.allreduce()), grads)
  with pytest.raises(ValueError, match="applied twice"):
    _reduce(optax.chain(jdist.cast(jnp.float16), jdist.cast(jnp.float16), jdist.allreduce()), grads)
  assert isinstance(half.to_half({"a": jnp.ones(2)}, jnp.float16, 1.0), protocol.WirePayload)
  with pytest.raises(ValueError, match="must come before jdist.cast"):
    _reduce(optax.chain(jdist.topk(0.1), jdist.topk(0.1), jdist.allreduce()), grads)
