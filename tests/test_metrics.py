"""Metrics reduced over every replica equal numpy on the whole global data set."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist import metrics
from tests import reference

EXAMPLES = 37  # not a multiple of any global batch: the last one is short
PER_REPLICA = 4
FEATURES = 5
CLASSES = 3


def _data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
  y = rng.integers(0, CLASSES, size=EXAMPLES).astype(np.int32)
  w = rng.uniform(0.5, 2.0, size=EXAMPLES).astype(np.float32)
  kernel = rng.normal(size=(FEATURES, CLASSES)).astype(np.float32)
  return x, y, w, kernel


def _numpy_metrics(x, y, w, kernel):
  logits = x.astype(np.float64) @ kernel.astype(np.float64)
  logits -= logits.max(axis=1, keepdims=True)
  log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
  loss = -log_probs[np.arange(len(y)), y]
  correct = (logits.argmax(axis=1) == y).astype(np.float64)
  w = w.astype(np.float64)
  return {"loss": (w * loss).sum() / w.sum(), "accuracy": (w * correct).sum() / w.sum(),
          "count": len(y), "weight": w.sum()}


@functools.lru_cache(maxsize=None)
def _eval_step():
  @jdist.data_parallel
  def step(kernel, x, y, w):
    logits = x @ kernel
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return metrics.metric_sums(loss, jnp.argmax(logits, -1) == y, w)
  return step


def _run_epoch(topo, x, y, w, kernel):
  """Every step: a global batch of PER_REPLICA rows per replica, padded at the end."""
  global_batch = topo.replica_count * PER_REPLICA
  steps = math.ceil(EXAMPLES / global_batch)
  pad = steps * global_batch - EXAMPLES
  # Padded rows hold NaN inputs and a weight of 0: they must not count at all.
  x = np.concatenate([x, np.full((pad, FEATURES), np.nan, np.float32)])
  y = np.concatenate([y, np.zeros(pad, np.int32)])
  w = np.concatenate([w, np.zeros(pad, np.float32)])
  kernel = jdist.replicate(kernel)
  accumulator = metrics.MetricAccumulator()
  for step in range(steps):
    rows = slice(step * global_batch, (step + 1) * global_batch)
    accumulator.add(_eval_step()(
        kernel, *(reference.local_slices(a[rows], topo, PER_REPLICA) for a in (x, y, w))))
  return accumulator


@pytest.mark.parametrize("weighted", [False, True], ids=["mask", "weights"])
def test_epoch_metrics_equal_numpy_on_global_data(topo, weighted):
  x, y, w, kernel = _data()
  if not weighted:
    w = np.ones_like(w)
  accumulator = _run_epoch(topo, x, y, w, kernel)
  result = accumulator.result()
  expected = _numpy_metrics(x, y, w, kernel)
  assert result["count"] == EXAMPLES
  np.testing.assert_allclose(result["loss"], expected["loss"], rtol=1e-6)
  np.testing.assert_allclose(result["accuracy"], expected["accuracy"], rtol=1e-6)
  np.testing.assert_allclose(result["weight"], expected["weight"], rtol=1e-6)
  # Every process reports the same numbers.
  everyone = jdist.runtime.host.allgather_object(result)
  assert all(other == everyone[0] for other in everyone)


def test_add_keeps_device_arrays_until_result(topo):
  x, y, w, kernel = _data(seed=1)
  accumulator = _run_epoch(topo, x, y, w, kernel)
  pending = accumulator._pending  # pylint: disable=protected-access
  assert len(pending) == accumulator.steps > 0
  assert all(isinstance(value, jax.Array) and value.ndim == 0
             for step in pending for value in step.values())
  first = accumulator.result()
  assert accumulator.result() == first  # reading twice changes nothing
  accumulator.reset()
  assert accumulator.steps == 0
  with pytest.raises(ValueError, match="total weight"):
    accumulator.result()


def test_sums_are_reduced_over_every_replica(topo):
  @jdist.data_parallel
  def step(ones):
    return metrics.metric_sums(ones, ones, ones)

  sums = step(np.ones((topo.local_device_count, 3), np.float32))
  for replica in jdist.local_replicas(sums):
    assert float(replica["loss_sum"]) == 3 * topo.replica_count
    assert int(replica["count"]) == 3 * topo.replica_count
    assert replica["count"].dtype == np.int32


def test_bad_inputs_are_named(topo):
  with pytest.raises(jdist.errors.CollectiveContextError, match="jdist.metric_sums"):
    metrics.metric_sums(jnp.ones(3), jnp.ones(3))

  @jdist.data_parallel
  def mismatched(loss, correct):
    return metrics.metric_sums(loss, correct)

  devices = topo.local_device_count
  with pytest.raises(jdist.errors.ShapeError, match="correct_per_example has shape"):
    mismatched(np.ones((devices, 3), np.float32), np.ones((devices, 4), np.float32))
  with pytest.raises(jdist.errors.ShapeError, match="one loss per example"):
    mismatched(np.ones((devices, 3, 2), np.float32), np.ones((devices, 3), np.float32))
  with pytest.raises(ValueError, match="keys"):
    metrics.MetricAccumulator().add({"loss": 1.0})
