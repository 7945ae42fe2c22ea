"""Tests of jdist.app.models: shapes, parameter counts, state handling, loss helpers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.app import models

SHAPES = [(28, 28, 1), (8, 8, 1), (32, 32, 3)]


def _key(seed):
  # The models do not care which PRNG the key uses; "rbg" keys compile far
  # faster on CPU than threefry ones, which keeps these tests quick.
  return jax.random.key(seed, impl="rbg")


def _abstract_init(model, input_shape):
  """Initializes `model` abstractly: shapes only, no compilation."""
  x = jax.ShapeDtypeStruct((2, *input_shape), jnp.float32)
  init = functools.partial(model.init, train=False)
  return jax.eval_shape(init, _key(0), x), x


@pytest.mark.parametrize("input_shape", SHAPES)
@pytest.mark.parametrize("name", ["cnn", "mlp", "resnet8", "resnet20", "resnet20_gn"])
def test_output_shape(name, input_shape):
  model = models.create_model(name, num_classes=7, input_shape=input_shape)
  variables, x = _abstract_init(model, input_shape)
  for train in (False, True):
    logits, _ = jax.eval_shape(
        functools.partial(model.apply, train=train, mutable=["batch_stats"]), variables, x)
    assert logits.shape == (2, 7)
    assert logits.dtype == jnp.float32


def test_cnn_matches_singa_on_mnist():
  model = models.create_model("cnn", num_classes=10, input_shape=(28, 28, 1))
  assert model.padding == "VALID"
  variables, _ = _abstract_init(model, (28, 28, 1))
  counts = {k: models.param_count(v) for k, v in variables["params"].items()}
  assert counts == {"Conv_0": 520, "Conv_1": 25_050, "Dense_0": 400_500, "Dense_1": 5_010}
  assert models.param_count(variables["params"]) == 431_080


def test_cnn_pads_small_inputs():
  assert models.create_model("cnn", num_classes=10, input_shape=(8, 8, 1)).padding == "SAME"
  assert models.create_model("cnn", num_classes=10, input_shape=(32, 32, 3)).padding == "VALID"


@pytest.mark.parametrize("name", ["resnet20", "resnet20_gn"])
def test_resnet20_has_paper_param_count(name):
  # He et al. 2016 report 0.27M; option-A shortcuts add no parameters.
  model = models.create_model(name, num_classes=10, input_shape=(32, 32, 3))
  variables, _ = _abstract_init(model, (32, 32, 3))
  assert models.param_count(variables["params"]) == 269_722


def test_create_model_rejects_unknown_name():
  with pytest.raises(ValueError, match="Unknown model 'vgg'.*cnn.*mlp.*resnet20"):
    models.create_model("vgg", num_classes=10, input_shape=(8, 8, 1))


def test_create_model_rejects_batched_shape():
  with pytest.raises(ValueError, match="without the batch dimension"):
    models.create_model("cnn", num_classes=10, input_shape=(4, 8, 8, 1))


def test_resnet_rejects_unknown_norm():
  model = models.ResNet(stage_sizes=(1, 1, 1), norm="layer")
  with pytest.raises(ValueError, match="batch.*group"):
    _abstract_init(model, (8, 8, 1))


def _batch(input_shape, n=8, num_classes=10, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, *input_shape)).astype(np.float32)
  y = rng.integers(0, num_classes, size=n).astype(np.int32)
  return jnp.asarray(x), jnp.asarray(y)


# Small variants keep compilation fast; each covers one model class and norm.
SMALL_MODELS = {
    "cnn": lambda: models.create_model("cnn", num_classes=10, input_shape=(8, 8, 1)),
    "mlp": lambda: models.MLP(features=(32,), num_classes=10),
    "resnet8": lambda: models.resnet8(num_classes=10, num_filters=8),
    "resnet8_gn": lambda: models.resnet8(
        num_classes=10, num_filters=8, norm="group", num_groups=4),
}


@functools.cache
def _initialized(name):
  """`(model, params, model_state)` of a small model, built once per session."""
  model = SMALL_MODELS[name]()
  return (model, *models.init_model(model, _key(1), (8, 8, 1)))


def test_batchnorm_state_changes_only_in_training():
  model, params, state = _initialized("resnet8")
  assert set(state) == {"batch_stats"}
  x, _ = _batch((8, 8, 1), n=4)
  apply = jax.jit(models.apply_model, static_argnums=0, static_argnames="train")

  _, eval_state = apply(model, params, state, x, train=False)
  jax.tree.map(np.testing.assert_array_equal, eval_state, state)

  _, train_state = apply(model, params, state, x, train=True)
  assert jax.tree.structure(train_state) == jax.tree.structure(state)
  changed = jax.tree.map(lambda a, b: not np.allclose(a, b), train_state, state)
  assert all(jax.tree.leaves(changed))


def test_groupnorm_resnet_is_stateless():
  assert models.create_model("resnet8_gn", num_classes=10, input_shape=(8, 8, 1)).norm == "group"
  model, params, state = _initialized("resnet8_gn")
  assert state == {}
  x, _ = _batch((8, 8, 1), n=2)
  apply = functools.partial(models.apply_model, model, train=True)
  _, new_state = jax.eval_shape(apply, params, state, x)
  assert new_state == {}


def _log_softmax(logits):
  shifted = logits - logits.max(axis=1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


LOGITS = np.array([[2.0, 1.0, 0.0],
                   [0.5, 0.5, 3.0],
                   [1.0, -1.0, 0.0],
                   [0.0, 4.0, 1.0]], np.float32)
LABELS = np.array([0, 1, 0, 1], np.int32)

# Jitted once here, as the trainer uses them.
jit_loss = jax.jit(models.cross_entropy_loss)
jit_loss_grad = jax.jit(jax.grad(models.cross_entropy_loss))
jit_count = jax.jit(models.correct_count)


def test_cross_entropy_loss_unweighted():
  expected = -_log_softmax(LOGITS)[np.arange(4), LABELS].mean()
  np.testing.assert_allclose(jit_loss(LOGITS, LABELS), expected, rtol=1e-6)
  # By hand, row 0: log(e^2 + e^1 + e^0) - 2.
  row0 = np.log(np.exp(2.0) + np.exp(1.0) + 1.0) - 2.0
  np.testing.assert_allclose(jit_loss(LOGITS[:1], LABELS[:1]), row0, rtol=1e-6)


def test_cross_entropy_loss_ignores_zero_weight_rows():
  weights = np.array([1.0, 1.0, 0.0, 0.0], np.float32)
  expected = -_log_softmax(LOGITS)[[0, 1], [0, 1]].mean()
  np.testing.assert_allclose(jit_loss(LOGITS, LABELS, weights), expected, rtol=1e-6)
  # Padding rows' contents matter neither to the loss nor to its gradient.
  padded = LOGITS.copy()
  padded[2:] = [[100.0, -100.0, 7.0], [-50.0, 0.0, 50.0]]
  np.testing.assert_allclose(jit_loss(padded, LABELS, weights), expected, rtol=1e-6)
  grads = jit_loss_grad(jnp.asarray(padded), LABELS, weights)
  np.testing.assert_array_equal(grads[2:], 0.0)
  # Fractional weights give a weighted mean.
  weights = np.array([3.0, 1.0, 0.0, 0.0], np.float32)
  expected = -(3 * _log_softmax(LOGITS)[0, 0] + _log_softmax(LOGITS)[1, 1]) / 4
  np.testing.assert_allclose(jit_loss(LOGITS, LABELS, weights), expected, rtol=1e-6)


def test_cross_entropy_loss_all_padding_is_zero_with_finite_grad():
  weights = np.zeros(4, np.float32)
  assert jit_loss(LOGITS, LABELS, weights) == 0.0
  grads = jit_loss_grad(jnp.asarray(LOGITS), LABELS, weights)
  np.testing.assert_array_equal(grads, 0.0)


def test_correct_count():
  # argmax per row: 0, 2, 0, 1 -> rows 0, 2, 3 are correct.
  assert jit_count(LOGITS, LABELS) == 3.0
  weights = np.array([1.0, 1.0, 0.0, 1.0], np.float32)
  assert jit_count(LOGITS, LABELS, weights) == 2.0
  assert jit_count(LOGITS, LABELS, np.zeros(4, np.float32)) == 0.0


@pytest.mark.parametrize("name", sorted(SMALL_MODELS))
def test_sgd_step_reduces_loss(name):
  model, params, state = _initialized(name)
  x, y = _batch((8, 8, 1))
  weights = jnp.ones(8).at[-1].set(0.0)

  @jax.jit
  def sgd_step(params, state, x, y, weights):
    def loss_fn(params):
      logits, new_state = models.apply_model(model, params, state, x, train=True)
      return models.cross_entropy_loss(logits, y, weights), new_state
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    return loss, params, new_state

  loss_before, params, new_state = sgd_step(params, state, x, y, weights)
  loss_after, _, _ = sgd_step(params, new_state, x, y, weights)
  assert np.isfinite(loss_before)
  assert loss_after < loss_before
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
