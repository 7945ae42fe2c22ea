"""`jdist.skip_nonfinite`: a NaN on one replica makes every replica skip that step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist import consistency
from jdist import errors
from jdist.transforms.finite import SkipNonFiniteState
from jdist.transforms.finite import skip_nonfinite
from tests import reference

PER_REPLICA = 4
STEPS = 5
NAN_STEP = 3  # 1-based


def test_nan_in_one_replicas_batch_makes_every_replica_skip_the_step(topo):
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(3), x0)
  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=s)
             for s in range(STEPS)]
  # The last replica's rows of step 3's batch are NaN: only its gradients are.
  poisoned_x = batches[NAN_STEP - 1][0].copy()
  poisoned_x[(topo.replica_count - 1) * PER_REPLICA:] = np.nan
  poisoned = list(batches)
  poisoned[NAN_STEP - 1] = (poisoned_x, batches[NAN_STEP - 1][1])

  inner = optax.sgd(0.05, momentum=0.9)
  # Reference: one device, the same steps with step 3 left out entirely
  # (momentum included: a skipped step must not touch the inner state).
  kept = [b for i, b in enumerate(batches) if i != NAN_STEP - 1]
  expected = reference.train_reference(model, params, inner, kept, STEPS - 1)

  tx = skip_nonfinite(jdist.dist_opt(inner))
  replicated, opt_state = reference.train_jdist(model, params, tx, poisoned, STEPS, topo,
                                                PER_REPLICA)
  assert consistency.check_replicas(replicated) == []  # bit-identical, every process
  for replica in jdist.local_replicas(replicated):
    reference.assert_trees_close(replica, expected, rtol=1e-5, atol=1e-6)
  state = jdist.unreplicate(opt_state)
  assert isinstance(state, SkipNonFiniteState)
  assert int(state.skipped) == 1 and int(state.consecutive) == 0
  assert consistency.check_replicas(opt_state) == []


def _train_on_gradients(tx, grads_per_step, topo):
  """Feeds given per-replica gradients ([steps, replicas, n]) to `tx`; w starts at 0."""
  params = {"w": jnp.zeros((grads_per_step.shape[-1],), jnp.float32)}
  replicated = jdist.replicate(params)
  state = jdist.data_parallel(tx.init)(replicated)

  @jdist.data_parallel
  def step(params, state, grads):
    updates, state = tx.update({"w": grads}, state, params)
    return optax.apply_updates(params, updates), state

  history = []
  for grads in grads_per_step:
    replicated, state = step(replicated, state, grads[np.array(topo.replica_indices)])
    unreplicated = jdist.unreplicate(state)
    history.append((np.asarray(jdist.unreplicate(replicated)["w"]),
                    int(unreplicated.skipped), int(unreplicated.consecutive)))
  # Every replica took the same decisions: bit-identical everywhere.
  assert consistency.check_replicas((replicated, state)) == []
  return history


def test_max_consecutive_lets_the_next_nonfinite_step_through(topo):
  replicas = topo.replica_count
  grads = np.ones((5, replicas, 3), np.float32)
  grads[1:4, replicas - 1, 0] = np.inf  # steps 2, 3, 4 are non-finite on one replica
  history = _train_on_gradients(skip_nonfinite(jdist.dist_opt(optax.sgd(1.0)),
                                               max_consecutive=2), grads, topo)
  w, skipped, consecutive = zip(*history)
  np.testing.assert_array_equal(w[0], -np.ones(3))      # step 1 applied
  np.testing.assert_array_equal(w[2], -np.ones(3))      # steps 2 and 3 skipped
  assert skipped[:3] == (0, 1, 2) and consecutive[:3] == (0, 1, 2)
  assert np.isinf(w[3][0]) and skipped[3] == 2 and consecutive[3] == 0  # step 4 let through
  assert skipped[4] == 2 and consecutive[4] == 0


def test_without_a_limit_every_nonfinite_step_is_skipped(topo):
  replicas = topo.replica_count
  grads = np.full((4, replicas, 2), 0.5, np.float32)
  grads[:3, 0, 1] = np.nan  # replica 0 (process 0) is NaN for 3 steps
  history = _train_on_gradients(skip_nonfinite(jdist.dist_opt(optax.sgd(1.0))), grads, topo)
  w, skipped, consecutive = zip(*history)
  np.testing.assert_array_equal(w[2], np.zeros(2))
  assert skipped == (1, 2, 3, 3) and consecutive == (1, 2, 3, 0)
  np.testing.assert_array_equal(w[3], -0.5 * np.ones(2))


def test_skip_nonfinite_needs_a_data_parallel_step():
  tx = skip_nonfinite(optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  with pytest.raises(errors.CollectiveContextError, match="jdist.data_parallel"):
    tx.update({"w": jnp.ones(2)}, tx.init(params), params)


def test_skip_nonfinite_rejects_bad_arguments():
  with pytest.raises(ValueError, match="not an optax.GradientTransformation"):
    skip_nonfinite("sgd")
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match=f"max_consecutive={bad!r} must be None"):
      skip_nonfinite(optax.sgd(0.1), max_consecutive=bad)


def test_overflow_on_the_16_bit_wire_is_skipped_like_a_nan(topo):
  # Finite float32 gradients whose float16 payload overflows (1e6 / replicas is
  # past float16's 65504): the decision must see the exchanged updates, not
  # only the local gradients.
  replicas = topo.replica_count
  grads = np.full((3, replicas, 2), 0.5, np.float32)
  grads[1, replicas - 1] = 1e6  # step 2: one replica sends a huge, finite gradient
  history = _train_on_gradients(
      skip_nonfinite(jdist.dist_opt(optax.sgd(1.0), half=jnp.float16)), grads, topo)
  w, skipped, _ = zip(*history)
  assert all(np.all(np.isfinite(x)) for x in w), w
  assert skipped == (0, 1, 1)
  np.testing.assert_allclose(w[2], -np.ones(2), rtol=1e-3)
