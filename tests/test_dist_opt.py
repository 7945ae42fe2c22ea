"""N replicas on batches of B train like one device on the N*B batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from tests import reference

STEPS = 20
PER_REPLICA = 4


@pytest.mark.parametrize("model_cls", [reference.TinyMLP, reference.TinyCNN])
def test_dist_opt_matches_single_device(topo, model_cls):
  model = model_cls()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(100), x0)  # what rank 0 initializes
  # Each process starts from its own init; broadcast makes them rank 0's.
  own = model.init(jax.random.key(100 + topo.process_index), x0)
  start = jdist.broadcast_params(own)
  reference.assert_trees_close(start, params, rtol=0, atol=0)

  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=s) for s in range(3)]
  inner = optax.sgd(0.05, momentum=0.9)
  expected = reference.train_reference(model, params, inner, batches, STEPS)
  replicated, _ = reference.train_jdist(model, start, jdist.dist_opt(inner), batches, STEPS,
                                        topo, PER_REPLICA)
  for replica in jdist.local_replicas(replicated):
    reference.assert_trees_close(replica, expected, rtol=1e-5, atol=1e-6)


def test_allreduce_sum_mode_is_replica_count_times_mean(topo):
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(0), x0)
  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=7)]
  # Summed gradients with lr/R are averaged gradients with lr.
  expected = reference.train_reference(model, params, optax.sgd(0.1), batches, 5)
  tx = optax.chain(jdist.allreduce(mean=False), optax.sgd(0.1 / topo.replica_count))
  replicated, _ = reference.train_jdist(model, params, tx, batches, 5, topo, PER_REPLICA)
  reference.assert_trees_close(jdist.unreplicate(replicated), expected, rtol=1e-5, atol=1e-6)


# eps well above float32 rounding of the gradients: Adam divides by sqrt(v), so
# with the default 1e-8 an entry whose gradient is a rounding error (summed in
# another order over 8 replicas than on one device) moves by up to the
# learning rate (seen in 2 x 4: 8.9e-5 on a 0.0017 weight after 10 steps).
@pytest.mark.parametrize("inner", [optax.adam(1e-2, eps=1e-4),
                                   optax.adamw(1e-2, eps=1e-4, weight_decay=1e-3)],
                         ids=["adam", "adamw"])
def test_dist_opt_wraps_any_optimizer(topo, inner):
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(1), x0)
  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=3)]
  expected = reference.train_reference(model, params, inner, batches, 10)
  replicated, _ = reference.train_jdist(model, params, jdist.dist_opt(inner), batches, 10,
                                        topo, PER_REPLICA)
  reference.assert_trees_close(jdist.unreplicate(replicated), expected, rtol=1e-4, atol=1e-6)


def test_multisteps_accumulation_matches_large_batch(topo):
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(2), x0)
  half_a = reference.global_batch(topo.replica_count, PER_REPLICA, seed=11)
  half_b = reference.global_batch(topo.replica_count, PER_REPLICA, seed=12)
  # Reference: one step on both micro-batches' mean gradient.
  merged = [(np.concatenate([half_a[0], half_b[0]]), np.concatenate([half_a[1], half_b[1]]))]
  expected = reference.train_reference(model, params, optax.sgd(0.1), merged, 1)
  tx = optax.MultiSteps(jdist.dist_opt(optax.sgd(0.1)), every_k_schedule=2)
  replicated, _ = reference.train_jdist(model, params, tx, [half_a, half_b], 2, topo, PER_REPLICA)
  reference.assert_trees_close(jdist.unreplicate(replicated), expected, rtol=1e-5, atol=1e-6)


def test_dist_opt_rejects_bad_arguments():
  with pytest.raises(ValueError, match="not an optax.GradientTransformation"):
    jdist.dist_opt("sgd")
  with pytest.raises(ValueError, match="does not combine"):
    jdist.dist_opt(optax.sgd(0.1), partial=4, half=True)
  with pytest.raises(ValueError, match="does not combine"):
    jdist.dist_opt(optax.sgd(0.1), partial=4, sparsify="topk:0.01")
  with pytest.raises(ValueError, match="sparsify="):
    jdist.dist_opt(optax.sgd(0.1), sparsify="topq:0.1")
  with pytest.raises(ValueError, match="error_feedback=False only applies"):
    jdist.dist_opt(optax.sgd(0.1), error_feedback=False)
  with pytest.raises(ValueError, match="momentum_correction=0.9 only applies"):
    jdist.dist_opt(optax.sgd(0.1), momentum_correction=0.9)
  with pytest.raises(ValueError, match="bucket_bytes"):
    jdist.allreduce(bucket_bytes=0)
  with pytest.raises(ValueError, match="mean="):
    jdist.allreduce(mean="yes")


def test_every_scheme_is_one_keyword_declared_once():
  import inspect  # pylint: disable=import-outside-toplevel
  from jdist.transforms import dist_opt as dist_opt_lib  # pylint: disable=import-outside-toplevel
  keywords = set(inspect.signature(jdist.dist_opt).parameters) - {"inner"}
  assert set(dist_opt_lib.SCHEMES) <= keywords
  assert keywords - set(dist_opt_lib.SCHEMES) == set(dist_opt_lib.OPTIONS)
  for name, scheme in dist_opt_lib.SCHEMES.items():
    assert scheme.keyword == name and set(scheme.options) <= set(dist_opt_lib.OPTIONS)
    assert set(scheme.combines_with) <= set(dist_opt_lib.SCHEMES), name
  # The declarations decide: half combines with sparsify and diloco, and each says so.
  assert dist_opt_lib.check_schemes({"sparsify": "topk:0.1", "half": True}, {})
  with pytest.raises(ValueError, match="--partial averages .* cannot be combined with --half"):
    dist_opt_lib.check_schemes({"partial": 2, "half": True}, {},
                               spell=lambda name: "--" + name.replace("_", "-"))


def test_wrapping_schemes_build_their_transformation():
  params = {"w": jnp.ones((3, 2))}
  state = jdist.dist_opt(optax.sgd(0.1), diloco=4, half=True).init(params)
  assert isinstance(state, jdist.DiLoCoState)
  state = jdist.dist_opt(optax.sgd(0.1), local_sgd=4, local_sgd_warmup=2).init(params)
  assert isinstance(state, jdist.LocalSGDState)
  with pytest.raises(ValueError, match="local_sgd_warmup=2 only applies with local_sgd="):
    jdist.dist_opt(optax.sgd(0.1), local_sgd_warmup=2)
  with pytest.raises(ValueError, match="mean=False only applies"):
    jdist.dist_opt(optax.sgd(0.1), diloco=4, mean=False)
