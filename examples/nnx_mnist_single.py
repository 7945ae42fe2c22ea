"""Flax NNX's MNIST tutorial CNN, trained on one device: the baseline of nnx_mnist.py.

The model, optimizer, metrics and steps follow flax's NNX MNIST tutorial
(`nnx.Optimizer`, `nnx.MultiMetric`, `nnx.jit`); the data come from
`jdist.datasets` so nothing is downloaded (digits by default, or
Fashion-MNIST from Debian's `dataset-fashion-mnist`). `nnx_mnist.py` is this
file made data-parallel with jdist; `diff` the two to see the changes.

    .venv/bin/python examples/nnx_mnist_single.py --epochs 2
"""

import argparse
from functools import partial

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdist.app import datasets


class CNN(nnx.Module):
  """The tutorial's CNN; `side` is the input's height and width."""

  def __init__(self, side: int, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear((side // 4) ** 2 * 64, 256, rngs=rngs)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x):
    x = self.avg_pool(nnx.relu(self.conv1(x)))
    x = self.avg_pool(nnx.relu(self.conv2(x)))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.linear1(x))
    return self.linear2(x)


def loss_fn(model: CNN, batch):
  logits = model(batch["image"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return loss, logits


@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)
  return loss


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])


def batches(images, labels, batch_size, order):
  for start in range(0, len(order) - batch_size + 1, batch_size):  # drop the remainder
    rows = order[start:start + batch_size]
    yield {"image": images[rows], "label": labels[rows]}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="digits", help="digits or fashion_mnist")
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=32, help="the global batch")
  parser.add_argument("--learning-rate", type=float, default=0.005)
  parser.add_argument("--max-steps", type=int, help="stop after this many steps")
  args = parser.parse_args(argv)
  data = datasets.load(args.dataset)
  train_x, test_x = data.train_x.astype(np.float32), data.test_x.astype(np.float32)

  model = CNN(train_x.shape[1], rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(args.learning_rate, 0.9), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  history = {"step_loss": [], "train_loss": [], "train_accuracy": [], "test_loss": [],
             "test_accuracy": []}
  for epoch in range(args.epochs):
    order = np.random.default_rng(epoch).permutation(len(train_x))
    for batch in batches(train_x, data.train_y, args.batch_size, order):
      history["step_loss"].append(float(train_step(model, optimizer, metrics, batch)))
      if len(history["step_loss"]) == args.max_steps:
        return history
    for metric, value in metrics.compute().items():
      history[f"train_{metric}"].append(float(value))
    metrics.reset()
    for batch in batches(test_x, data.test_y, args.batch_size, np.arange(len(test_x))):
      eval_step(model, metrics, batch)
    for metric, value in metrics.compute().items():
      history[f"test_{metric}"].append(float(value))
    metrics.reset()
    print(f"epoch {epoch + 1}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in history.items() if k != "step_loss"))
  return history


if __name__ == "__main__":
  main()
