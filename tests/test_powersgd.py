"""powersgd: low-rank factors summed over replicas, error feedback, warm start, bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdist
from tests import reference

PER_REPLICA = 4
SHAPES = {"b": (16,), "kernel": (3, 3, 4, 8), "small": (3, 4), "w": (32, 16)}


def _replica_grads(topo, seed=0):
  """Different gradients on every replica: this process's [local_devices, *shape]
  slices, and every replica's."""
  rng = np.random.default_rng(seed)
  every = {name: rng.normal(size=(topo.replica_count,) + shape).astype(np.float32)
           for name, shape in SHAPES.items()}
  mine = list(topo.replica_indices)
  return {name: value[mine] for name, value in every.items()}, every


def _run(tx, grad_steps):
  """Runs `tx` alone; per step: its output, the state before and after, every
  replica's Q factors (gathered in the step)."""

  @jdist.data_parallel
  def step(g, state):
    out, new_state = tx.update(g, state)
    return out, new_state, jdist.all_gather(new_state.q)

  state = jdist.data_parallel(tx.init)(grad_steps[0])
  log = []
  for g in grad_steps:
    out, new_state, gathered_q = step(g, state)
    log.append((out, state, new_state, gathered_q))
    state = new_state
  return log


def test_full_rank_one_step_equals_the_plain_average(topo):
  grads, every = _replica_grads(topo)
  tx = jdist.powersgd(rank=64, min_compression_rate=0)  # rank clipped to min(n, m)
  [(out, _, state, _)] = _run(tx, [grads])
  assert len(state.q) == 3  # kernel, small, w: every matrix is factored
  for name in SHAPES:
    np.testing.assert_allclose(np.asarray(out[name]),
                               np.broadcast_to(every[name].mean(0), out[name].shape),
                               rtol=1e-4, atol=1e-5, err_msg=name)


def test_error_feedback_loses_nothing_and_q_is_warm_started_equal_everywhere(topo):
  steps = [_replica_grads(topo, seed=s)[0] for s in range(3)]
  tx = jdist.powersgd(rank=1, min_compression_rate=0)
  log = _run(tx, steps)
  matrices = ("kernel", "small", "w")  # the factored leaves, in leaf order
  for g, (out, before, after, gathered_q) in zip(steps, log):
    for i, name in enumerate(matrices):
      shape = (g[name].shape[0], -1, SHAPES[name][-1])
      sent = np.asarray(out[name]).reshape(shape)
      np.testing.assert_allclose(sent + np.asarray(after.residual[i]),
                                 np.asarray(g[name]).reshape(shape)
                                 + np.asarray(before.residual[i]),
                                 rtol=1e-5, atol=1e-5, err_msg=name)
      # Every replica holds one Q, and it moved from the last step's.
      q = np.asarray(gathered_q[i])
      np.testing.assert_array_equal(q, np.broadcast_to(q[:, :1], q.shape))
      assert not np.allclose(np.asarray(after.q[i]), np.asarray(before.q[i]))
  # Rank 1 is lossy: something is left for later steps.
  assert np.abs(np.asarray(log[-1][2].residual[2])).max() > 1e-3
  np.testing.assert_array_equal(np.asarray(log[-1][2].step), 3)


def test_without_error_feedback_no_residual_is_kept(topo):
  grads, _ = _replica_grads(topo)
  [(out, _, state, _)] = _run(jdist.powersgd(rank=2, error_feedback=False), [grads])
  assert state.residual == ()
  assert np.isfinite(np.asarray(out["w"])).all()


def test_wire_bytes_are_the_factors_plus_dense_leaves_whatever_the_replica_count(topo):
  grads, _ = _replica_grads(topo)
  rank = 2
  [(_, _, state, _)] = _run(jdist.powersgd(rank=rank), [grads])
  # DDP's rule at rate 2: w (32x16) and kernel (36x8) are factored; the
  # small matrix and the bias travel dense.
  assert [q.shape[-2:] for q in state.q] == [(8, 2), (16, 2)]
  payload = ((36 + 8) * rank + (32 + 16) * rank + 3 * 4 + 16) * 4
  processes = topo.process_count
  sent = np.asarray(jdist.wire_bytes(state))
  # A ring all-reduce of b bytes sends 2(P-1)/P * b per process: no R in it
  # (each exchange's count is rounded to whole bytes: P, Q and the dense part).
  np.testing.assert_allclose(sent, 2 * (processes - 1) / processes * payload, atol=1.5)
  if processes > 1:
    assert (sent > 0).all()


@pytest.mark.parametrize("rank", [0, -1, 1.5, True, "4", None])
def test_bad_rank_raises_when_built(rank):
  with pytest.raises(ValueError, match="rank="):
    jdist.powersgd(rank)


def test_other_arguments_are_checked():
  with pytest.raises(ValueError, match="min_compression_rate=-1"):
    jdist.powersgd(2, min_compression_rate=-1)
  with pytest.raises(ValueError, match="error_feedback="):
    jdist.powersgd(2, error_feedback=1)
  with pytest.raises(ValueError, match="bucket_bytes=0"):
    jdist.powersgd(2, bucket_bytes=0)


def test_dist_opt_rejects_combinations_with_powersgd():
  for other in ({"half": True}, {"sparsify": "topk:0.1"}, {"partial": 2}):
    with pytest.raises(ValueError, match="does not combine"):
      jdist.dist_opt(optax.sgd(0.1), powersgd=2, **other)
  with pytest.raises(ValueError, match="momentum_correction=0.9 only applies"):
    jdist.dist_opt(optax.sgd(0.1), powersgd=2, momentum_correction=0.9)
  with pytest.raises(ValueError, match="rank=0"):
    jdist.dist_opt(optax.sgd(0.1), powersgd=0)


def test_a_compressor_before_powersgd_is_refused(topo):
  grads, _ = _replica_grads(topo)
  with pytest.raises(ValueError, match="put no jdist.cast"):
    _run(optax.chain(jdist.cast(jnp.float16), jdist.powersgd(2)), [grads])


def test_a_small_model_trains_through_dist_opt(topo):
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(0), x0)
  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=s) for s in range(2)]
  tx = jdist.dist_opt(optax.sgd(0.1, momentum=0.9), powersgd=2)
  replicated, opt_state = reference.train_jdist(model, params, tx, batches, 20, topo,
                                                PER_REPLICA)
  replicas = jdist.local_replicas(replicated)
  for replica in replicas[1:]:
    reference.assert_trees_close(replica, replicas[0], rtol=0, atol=0)
  loss = lambda p: float(np.mean([reference.loss_fn(model, p, x, y) for x, y in batches]))
  assert loss(replicas[0]) < 0.8 * loss(params)
  assert len(jdist.unreplicate(opt_state)[0].q) == 2  # both Dense kernels factored


def test_full_rank_in_a_global_jit_step_trains_like_one_device(topo):
  """The same reduction in a jit step over global arrays (one value per process)."""
  model = reference.TinyMLP()
  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=s) for s in range(2)]
  params = model.init(jax.random.key(0), batches[0][0][:1])
  expected = reference.train_reference(model, params, optax.sgd(0.1), batches, 3)
  tx = optax.chain(jdist.powersgd(64, min_compression_rate=0), optax.sgd(0.1))
  mesh = jdist.mesh()
  replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(jdist.DATA_AXIS))
  step = jax.jit(reference.train_step_fn(model, tx))
  with jax.set_mesh(mesh):
    trained = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(trained), replicated)
    for i in range(3):
      x, y = jax.device_put(jdist.process_slice(batches[i % 2]), sharded)
      trained, opt_state = step(trained, opt_state, x, y)
  reference.assert_trees_close(trained, expected, rtol=1e-4, atol=1e-5)
