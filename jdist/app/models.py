"""Models, and the loss and accuracy helpers the trainer uses.

Every model is a Flax linen module mapping a float32 batch (NHWC images; the
MLP flattens any `[N, ...]`) to logits `[N, num_classes]`, called with
`train=True` in training. `create_model` builds one by name from the `MODELS`
registry of factories `(num_classes, input_shape) -> module`, so a model can
adapt to its data; users may register their own.

`input_shape` is always ONE example's shape, without the batch dimension:
`(28, 28, 1)` for MNIST, `(8, 8, 1)` for sklearn digits.

Mutable model state (BatchNorm's `batch_stats`) is kept apart from `params`:
`init_model` returns `(params, model_state)` and `apply_model` threads
`model_state` through.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

PyTree = Any
ModelFactory = Callable[[int, Sequence[int]], nn.Module]


class CNN(nn.Module):
  """Apache SINGA's MNIST CNN: two conv/relu/max-pool stages and two dense layers.

  With the default "VALID" padding it has exactly SINGA's 431,080 parameters
  on 28x28x1 inputs. Inputs smaller than about 16x16 shrink to nothing under
  VALID 5x5 convolutions, so `create_model` picks "SAME" padding for inputs
  smaller than 28x28 (e.g. 8x8 sklearn digits).

  Attributes:
    num_classes: number of output logits.
    padding: padding of both convolutions, "VALID" (SINGA's) or "SAME".
  """

  num_classes: int = 10
  padding: str = "VALID"

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train  # No dropout or normalization: train and eval are the same.
    for features in (20, 50):
      x = nn.Conv(features, kernel_size=(5, 5), padding=self.padding)(x)
      x = nn.relu(x)
      x = nn.max_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(500)(x))
    return nn.Dense(self.num_classes)(x)


class MLP(nn.Module):
  """A multi-layer perceptron on flattened inputs.

  Attributes:
    features: widths of the hidden layers, each followed by a relu.
    num_classes: number of output logits.
  """

  features: Sequence[int] = (512, 256)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    del train
    x = x.reshape((x.shape[0], -1))
    for width in self.features:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.num_classes)(x)


class BasicBlock(nn.Module):
  """Two 3x3 convolutions with an identity shortcut (He et al. 2016, option A).

  When the block downsamples, the shortcut subsamples the input spatially and
  zero-pads its channels, so the shortcut has no parameters (as in the paper's
  CIFAR-10 networks).

  Attributes:
    filters: output channels.
    strides: stride of the first convolution (2 where a stage begins).
    norm: a constructor of the normalization layer.
  """

  filters: int
  strides: int
  norm: Callable[..., nn.Module]

  @nn.compact
  def __call__(self, x):
    conv = functools.partial(nn.Conv, kernel_size=(3, 3), padding="SAME", use_bias=False)
    y = conv(self.filters, strides=(self.strides, self.strides))(x)
    y = nn.relu(self.norm()(y))
    y = self.norm()(conv(self.filters)(y))
    shortcut = x[:, ::self.strides, ::self.strides, :]
    extra_channels = self.filters - x.shape[-1]
    if extra_channels:
      shortcut = jnp.pad(shortcut, ((0, 0), (0, 0), (0, 0), (0, extra_channels)))
    return nn.relu(y + shortcut)


class ResNet(nn.Module):
  """CIFAR-style ResNet (He et al. 2016, section 4.2): depth 6n+2.

  A 3x3 convolution, then one stage of BasicBlocks per entry of `stage_sizes`
  (filters doubling and resolution halving from stage to stage), global
  average pooling and a dense layer. `stage_sizes=(3, 3, 3)` is ResNet-20,
  with 269,722 parameters for 10 classes.

  Attributes:
    stage_sizes: BasicBlocks per stage; `(n, n, n)` gives depth 6n+2.
    num_classes: number of output logits.
    num_filters: filters of the first stage (16 in the paper).
    norm: "batch" (BatchNorm; running statistics live in the mutable
      `batch_stats` collection) or "group" (GroupNorm; no mutable state,
      which suits data-parallel training with per-replica batches).
    num_groups: groups of GroupNorm; must divide `num_filters`.
  """

  stage_sizes: Sequence[int] = (3, 3, 3)
  num_classes: int = 10
  num_filters: int = 16
  norm: str = "batch"
  num_groups: int = 8

  @nn.compact
  def __call__(self, x, train: bool = False):
    if self.norm == "batch":
      norm = functools.partial(
          nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
    elif self.norm == "group":
      norm = functools.partial(nn.GroupNorm, num_groups=self.num_groups, epsilon=1e-5)
    else:
      raise ValueError(f'ResNet norm must be "batch" or "group", got {self.norm!r}.')
    x = nn.Conv(self.num_filters, (3, 3), padding="SAME", use_bias=False)(x)
    x = nn.relu(norm()(x))
    for stage, num_blocks in enumerate(self.stage_sizes):
      for block in range(num_blocks):
        strides = 2 if stage > 0 and block == 0 else 1
        x = BasicBlock(self.num_filters * 2**stage, strides, norm)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


resnet8 = functools.partial(ResNet, stage_sizes=(1, 1, 1))
resnet20 = functools.partial(ResNet, stage_sizes=(3, 3, 3))
resnet32 = functools.partial(ResNet, stage_sizes=(5, 5, 5))
resnet56 = functools.partial(ResNet, stage_sizes=(9, 9, 9))


def _image_shape(name: str, input_shape: Sequence[int]) -> tuple[int, ...]:
  """Checks that `input_shape` is one (height, width, channels) image."""
  if len(input_shape) != 3:
    raise ValueError(
        f"Model {name!r} takes images: input_shape must be one example's "
        f"(height, width, channels), without the batch dimension; got "
        f"{tuple(input_shape)}.")
  return tuple(input_shape)


def _cnn(num_classes: int, input_shape: Sequence[int]) -> nn.Module:
  height, width, _ = _image_shape("cnn", input_shape)
  # SINGA's VALID convolutions are kept wherever the input is MNIST-sized.
  padding = "VALID" if min(height, width) >= 28 else "SAME"
  return CNN(num_classes=num_classes, padding=padding)


def _mlp(num_classes: int, input_shape: Sequence[int]) -> nn.Module:
  del input_shape  # Any shape: the MLP flattens its input.
  return MLP(num_classes=num_classes)


def _resnet(depth: int, norm: str) -> ModelFactory:
  """A factory of the CIFAR ResNet with `depth` = 6n+2 layers."""
  def factory(num_classes: int, input_shape: Sequence[int]) -> nn.Module:
    _image_shape(f"resnet{depth}", input_shape)
    n = (depth - 2) // 6
    return ResNet(stage_sizes=(n, n, n), num_classes=num_classes, norm=norm)
  return factory


MODELS: dict[str, ModelFactory] = {
    "cnn": _cnn,
    "mlp": _mlp,
    **{f"resnet{depth}": _resnet(depth, "batch") for depth in (8, 20, 32, 56)},
    **{f"resnet{depth}_gn": _resnet(depth, "group") for depth in (8, 20, 32, 56)},
}


def create_model(name: str, *, num_classes: int, input_shape: Sequence[int]) -> nn.Module:
  """Builds the model registered in `MODELS` under `name`.

  Args:
    name: a key of `MODELS`, e.g. "cnn", "mlp", "resnet20" or "resnet20_gn".
    num_classes: number of output logits.
    input_shape: shape of one example, without the batch dimension.

  Returns:
    The Flax module, not yet initialized (see `init_model`).

  Raises:
    ValueError: `name` is not registered, or `input_shape` does not suit it.
  """
  if name not in MODELS:
    raise ValueError(f"Unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}.")
  return MODELS[name](num_classes, tuple(input_shape))


def init_model(model: nn.Module, rng: jax.Array,
               input_shape: Sequence[int]) -> tuple[PyTree, dict[str, PyTree]]:
  """Initializes `model` for examples of shape `input_shape`.

  Args:
    model: the module to initialize.
    rng: a PRNG key for the initial parameters.
    input_shape: shape of one example, without the batch dimension.

  Returns:
    `(params, model_state)`: the "params" collection, and a dict of every
    other collection (`{"batch_stats": ...}` for BatchNorm models, else `{}`).
  """
  dummy = jnp.zeros((1, *input_shape), jnp.float32)
  variables = dict(jax.jit(functools.partial(model.init, train=False))(rng, dummy))
  params = variables.pop("params")
  return params, variables


def param_count(params: PyTree) -> int:
  """Total number of scalars in `params`."""
  return sum(int(leaf.size) for leaf in jax.tree.leaves(params))


def apply_model(model: nn.Module, params: PyTree, model_state: dict[str, PyTree],
                x: jax.Array, *, train: bool) -> tuple[jax.Array, dict[str, PyTree]]:
  """Runs `model` on the batch `x`, threading its mutable state.

  In training BatchNorm uses the batch's statistics and updates its running
  averages, so the state collections are mutable; in evaluation, or for
  stateless models, `model_state` is returned unchanged.

  Args:
    model: the module.
    params: its "params" collection.
    model_state: its other collections, as returned by `init_model`.
    x: a batch of inputs.
    train: training mode (batch statistics) or evaluation (running averages).

  Returns:
    `(logits, new_model_state)`.
  """
  variables = {"params": params, **model_state}
  if train and model_state:
    logits, new_state = model.apply(variables, x, train=True, mutable=list(model_state))
    return logits, dict(new_state)
  return model.apply(variables, x, train=train), model_state


def _weights_or_ones(labels: jax.Array, weights: jax.Array | None) -> jax.Array:
  return jnp.ones(labels.shape) if weights is None else jnp.asarray(weights, jnp.float32)


def example_losses(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Softmax cross-entropy of every example, computed in float32.

  Args:
    logits: `[N, num_classes]`.
    labels: `[N]` integer class indices.

  Returns:
    A float32 `[N]` array.
  """
  return optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits, jnp.float32),
                                                         labels)


def example_correct(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Whether each example's top logit is its label: a bool `[N]` array."""
  return jnp.argmax(logits, axis=-1) == labels


def cross_entropy_loss(logits: jax.Array, labels: jax.Array,
                       weights: jax.Array | None = None) -> jax.Array:
  """Weighted mean softmax cross-entropy over the batch.

  Args:
    logits: `[N, num_classes]`.
    labels: `[N]` integer class indices.
    weights: optional `[N]` example weights; padding rows get weight 0 and
      contribute nothing, to the loss or to its gradient.

  Returns:
    A float32 scalar: `sum(weights * losses) / sum(weights)`, or 0 when all
    weights are 0.
  """
  losses = example_losses(logits, labels)
  weights = _weights_or_ones(labels, weights)
  total = jnp.sum(weights)
  # A safe denominator rather than jnp.where on the quotient: the latter would
  # still put 0/0 = NaN into the gradient of an all-padding batch.
  return jnp.sum(weights * losses) / jnp.where(total > 0, total, 1.0)


def correct_count(logits: jax.Array, labels: jax.Array,
                  weights: jax.Array | None = None) -> jax.Array:
  """Weighted number of examples whose top logit is the label.

  Args:
    logits: `[N, num_classes]`.
    labels: `[N]` integer class indices.
    weights: optional `[N]` example weights (0 for padding rows).

  Returns:
    A float32 scalar; divide by `sum(weights)` (summed over replicas) for
    the accuracy.
  """
  correct = example_correct(logits, labels).astype(jnp.float32)
  return jnp.sum(_weights_or_ones(labels, weights) * correct)
