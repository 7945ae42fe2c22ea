"""Apache SINGA's MNIST CNN example (examples/cnn, train_mpi.py), written for jdist.

    python examples/mnist_cnn.py                      # one process, every local device
    mpirun -np 2 python examples/mnist_cnn.py         # two processes (add --hostfile)
    python examples/mnist_cnn.py --dist-option sparseTopK --spars 0.01

Data: Fashion-MNIST or MNIST where installed (Debian's dataset-fashion-mnist
puts Fashion-MNIST in /usr/share/datasets/fashion-mnist), else sklearn's 8x8
digits, which need no files. `--dist-option` picks SINGA's DistOpt modes.
"""

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jdist
from jdist.app import datasets


class CNN(nn.Module):
  """SINGA's CNN: conv 5x5x20, pool, conv 5x5x50, pool, dense 500, dense 10."""
  num_classes: int = 10
  padding: str = "VALID"  # "SAME" for inputs too small for two VALID 5x5 convolutions

  @nn.compact
  def __call__(self, x):
    for features in (20, 50):
      x = nn.max_pool(nn.relu(nn.Conv(features, (5, 5), padding=self.padding)(x)), (2, 2), (2, 2))
    x = nn.relu(nn.Dense(500)(x.reshape((x.shape[0], -1))))
    return nn.Dense(self.num_classes)(x)


def load(name):
  """The dataset asked for; with "auto", the first one installed (never downloads)."""
  if name != "auto":
    return datasets.load(name)
  for candidate in ("fashion_mnist", "mnist"):
    try:
      return datasets.load(candidate, download=False)
    except datasets.DatasetError:
      pass
  return datasets.load("digits")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="auto", help="auto, fashion_mnist, mnist or digits")
  parser.add_argument("--dist-option", default="plain", choices=[
      "plain", "half", "partialUpdate", "sparseTopK", "sparseThreshold"])
  parser.add_argument("--spars", type=float, default=0.05, help="top-K ratio or threshold")
  parser.add_argument("--max-epoch", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=64, help="per replica")
  parser.add_argument("--lr", type=float, default=0.005)  # SINGA's SGD(lr=0.005, momentum=0.9)
  parser.add_argument("--limit", type=int, help="use only the first N training examples")
  args = parser.parse_args()

  topo = jdist.init()  # MPI under mpirun, else one process
  data = load(args.dataset)
  train_x, train_y = data.train_x[:args.limit], data.train_y[:args.limit]
  model = CNN(padding="VALID" if train_x.shape[1] >= 28 else "SAME")
  params = model.init(jax.random.key(topo.process_index), train_x[:1])  # differs per rank...
  params = jdist.broadcast_params(params)  # ...so every rank starts from rank 0's

  mode = {"plain": {}, "half": {"half": True}, "partialUpdate": {"partial": 4},
          "sparseTopK": {"sparsify": ("topk", args.spars)},
          "sparseThreshold": {"sparsify": ("threshold", args.spars)}}[args.dist_option]
  tx = jdist.dist_opt(optax.sgd(args.lr, momentum=0.9), **mode)

  @jdist.data_parallel
  def train_step(params, opt_state, batch):
    def loss_fn(p):
      logits = model.apply(p, batch["x"])
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
      return losses.mean(), (losses, jnp.argmax(logits, -1) == batch["y"])
    grads, (losses, correct) = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jdist.metric_sums(losses, correct)

  @jdist.data_parallel
  def eval_step(params, batch):
    logits = model.apply(params, batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jdist.metric_sums(losses, jnp.argmax(logits, -1) == batch["y"], batch["weight"])

  params = jdist.replicate(params)
  opt_state = jdist.data_parallel(tx.init)(params)
  train_loader = jdist.ShardedLoader({"x": train_x, "y": train_y}, batch_size=args.batch_size,
                                     topology=topo)
  test_loader = jdist.ShardedLoader({"x": data.test_x, "y": data.test_y}, topology=topo,
                                    batch_size=256, shuffle=False, drop_last=False,
                                    pad_with_weights=True)  # every test example exactly once
  if topo.is_primary:
    print(f"{data.name}: {len(train_x)} train / {len(data.test_x)} test; {topo}; "
          f"dist option {args.dist_option}", flush=True)
  for epoch in range(args.max_epoch):
    start, train_metrics = time.time(), jdist.MetricAccumulator()
    for batch in train_loader.epoch(epoch):
      params, opt_state, sums = train_step(params, opt_state, batch)
      train_metrics.add(sums)
    train = train_metrics.result()
    if args.dist_option == "partialUpdate":
      params = jdist.sync_params(params)  # replicas drift apart between chunk averages
    test_metrics = jdist.MetricAccumulator()
    for batch in test_loader.epoch(0):
      test_metrics.add(eval_step(params, batch))
    test = test_metrics.result()
    if topo.is_primary:
      print(f"epoch {epoch + 1}/{args.max_epoch}: training loss {train['loss']:.4f}, "
            f"accuracy {train['accuracy']:.2%} | test accuracy {test['accuracy']:.2%} | "
            f"{time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
  main()
