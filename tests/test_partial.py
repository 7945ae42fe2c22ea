"""partial_sync and sync_params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist import fusion
from jdist.transforms import partial as partial_lib
from tests import reference

PER_REPLICA = 4


def _setup(topo, seed=0):
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(seed), x0)
  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=s) for s in range(3)]
  return model, params, batches


def test_one_chunk_is_full_parameter_averaging(topo):
  # With plain SGD, averaging the locally updated parameters every step is
  # the same as averaging gradients: one device on the whole batch.
  model, params, batches = _setup(topo)
  expected = reference.train_reference(model, params, optax.sgd(0.05), batches, 6)
  tx = jdist.dist_opt(optax.sgd(0.05), partial=1)
  replicated, state = reference.train_jdist(model, params, tx, batches, 6, topo, PER_REPLICA)
  for replica in jdist.local_replicas(replicated):
    reference.assert_trees_close(replica, expected, rtol=1e-5, atol=1e-6)


def _flat_replicas(replicated):
  """Every replica's flat parameter vector, gathered to every process: [R, n]."""
  step = jdist.data_parallel(lambda p: jdist.all_gather(fusion.ravel(p)))
  return np.asarray(step(replicated)[0])


def test_rotating_chunk_is_averaged_each_step(topo):
  model, params, batches = _setup(topo, seed=1)
  chunks = 4
  tx = jdist.dist_opt(optax.sgd(0.05, momentum=0.9), partial=chunks)
  size = fusion.flat_spec(params).size
  chunk = -(-size // chunks)
  replicated = jdist.replicate(params)
  opt_state = jdist.data_parallel(tx.init)(replicated)

  step = jdist.data_parallel(reference.train_step_fn(model, tx))
  for number in range(chunks + 1):
    x, y = batches[number % len(batches)]
    replicated, opt_state = step(replicated, opt_state, reference.local_slices(x, topo, PER_REPLICA),
                                 reference.local_slices(y, topo, PER_REPLICA))
    every = _flat_replicas(replicated)
    current = number % chunks
    inside = slice(current * chunk, min((current + 1) * chunk, size))
    spread = every.max(axis=0) - every.min(axis=0)
    # The chunk just averaged agrees across replicas up to rounding...
    assert spread[inside].max() <= 1e-6
    if topo.replica_count > 1:
      # ...while a chunk averaged longer ago has drifted apart again.
      other = slice(((current + 1) % chunks) * chunk, min(((current + 1) % chunks + 1) * chunk, size))
      assert spread[other].max() > 1e-5
  # Cross-process traffic is one chunk's all-reduce, not the whole model.
  sent = float(jdist.wire_bytes(jdist.unreplicate(opt_state)))
  processes = topo.process_count
  assert sent == pytest.approx(2 * (processes - 1) / processes * chunk * 4)
  synced = jdist.sync_params(replicated)
  every = _flat_replicas(synced)
  assert (every == every[0]).all()  # identical, bit for bit


def test_partial_sync_needs_params_and_valid_chunks(topo):
  with pytest.raises(ValueError, match="num_chunks=0"):
    jdist.partial_sync(0)
  with pytest.raises(ValueError, match="num_chunks=2.5"):
    jdist.partial_sync(2.5)
  tx = jdist.partial_sync(2)

  @jdist.data_parallel
  def step(g):
    return tx.update(g, tx.init(g))[0]

  with pytest.raises(ValueError, match="needs them"):
    step(jdist.replicate({"w": jnp.ones(3)}))


def test_chunk_plan_cuts_the_flat_vector_across_leaves():
  plan = partial_lib.chunk_plan([3, 5, 2], 3)  # 10 elements, chunks of 4
  assert plan == [[(0, 0, 3), (1, 0, 1)], [(1, 1, 5)], [(2, 0, 2)]]
  assert partial_lib.chunk_plan([2], 4) == [[(0, 0, 1)], [(0, 1, 2)]]
  assert partial_lib.chunk_plan([], 4) == []


def test_partial_sync_matches_flat_reference(topo):
  # Leaves of 7, 1 and 12 elements in 3 chunks of 7: chunks cross leaves.
  rng = np.random.default_rng(5)
  shapes = {"a": (7,), "b": (1,), "c": (3, 4)}
  steps = 4
  every_params = {k: rng.normal(size=(topo.replica_count,) + s).astype(np.float32)
                  for k, s in shapes.items()}
  every_updates = [{k: rng.normal(size=(topo.replica_count,) + s).astype(np.float32)
                    for k, s in shapes.items()} for _ in range(steps)]
  tx = jdist.partial_sync(3)
  mine = list(topo.replica_indices)

  @jdist.data_parallel
  def step(u, state, p):
    return tx.update(u, state, p)

  params = {k: v[mine] for k, v in every_params.items()}
  state = jdist.data_parallel(tx.init)(params)

  def flat(tree):  # [replicas, 20] in leaf order a, b, c
    return np.concatenate([tree[k].reshape(tree[k].shape[0], -1) for k in "abc"], axis=1)

  for number in range(steps):
    out, state = step({k: v[mine] for k, v in every_updates[number].items()}, state, params)
    local = flat(every_params) + flat(every_updates[number])
    expected = flat(every_updates[number])
    inside = slice((number % 3) * 7, min((number % 3 + 1) * 7, 20))
    expected[:, inside] = local[:, inside].mean(0) - flat(every_params)[:, inside]
    np.testing.assert_allclose(flat({k: np.asarray(v) for k, v in out.items()}),
                               expected[mine], rtol=1e-5, atol=1e-6)
