"""Flax NNX's MNIST tutorial CNN, data-parallel per replica (nnx_mnist_single.py + 10 lines).

The same tutorial as nnx_mnist.py, in jdist's per-replica style: each local
device is a replica (`jdist.nnx_data_parallel` in place of `nnx.jit`, as
`jdist.data_parallel` is in place of `jax.pmap`), the model, optimizer and
metrics hold a copy per device, every process takes its rows of each global
batch, split over its devices, `jdist.dist_opt` averages the gradients,
`jdist.pmean` the logged loss and `jdist.replica_mean` the metrics. `diff`
it against nnx_mnist_single.py.

    .venv/bin/python examples/nnx_mnist_data_parallel.py --epochs 2      # every local device
    bash scripts/mpirun.sh -np 2 -x XLA_FLAGS=--xla_force_host_platform_device_count=2 \
      .venv/bin/python examples/nnx_mnist_data_parallel.py --epochs 2   # 2 processes x 2 devices
"""

import argparse
from functools import partial

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jdist
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


@jdist.nnx_data_parallel(out_axes=None)  # one replica per local device
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)
  return jdist.pmean(loss)  # the loss over every replica, as one device logs it


@jdist.nnx_data_parallel
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])


def batches(images, labels, batch_size, order):
  for start in range(0, len(order) - batch_size + 1, batch_size):  # drop the remainder
    rows = order[start:start + batch_size]
    yield jdist.shard(jdist.process_slice({"image": images[rows], "label": labels[rows]}))  # my replicas' rows


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
  optimizer = nnx.Optimizer(model, jdist.dist_opt(optax.adamw(args.learning_rate, 0.9)), wrt=nnx.Param)
  metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
  history = {"step_loss": [], "train_loss": [], "train_accuracy": [], "test_loss": [],
             "test_accuracy": []}
  for epoch in range(args.epochs):
    order = np.random.default_rng(epoch).permutation(len(train_x))
    for batch in batches(train_x, data.train_y, args.batch_size, order):
      history["step_loss"].append(float(train_step(model, optimizer, metrics, batch)))
      if len(history["step_loss"]) == args.max_steps:
        return history
    for metric, value in jdist.replica_mean(metrics.compute()).items():
      history[f"train_{metric}"].append(float(value))
    metrics.reset()
    for batch in batches(test_x, data.test_y, args.batch_size, np.arange(len(test_x))):
      eval_step(model, metrics, batch)
    for metric, value in jdist.replica_mean(metrics.compute()).items():
      history[f"test_{metric}"].append(float(value))
    metrics.reset()
    if jdist.init().is_primary:
      print(f"epoch {epoch + 1}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in history.items() if k != "step_loss"))
  return history


if __name__ == "__main__":
  main()
