"""A CIFAR-style ResNet (He et al. 2016) trained data-parallel with BatchNorm.

    python examples/resnet_cifar_style.py                       # synthetic 32x32x3 data
    mpirun -np 2 python examples/resnet_cifar_style.py --depth 20 --half bf16
    python examples/resnet_cifar_style.py --dataset digits      # sklearn's 8x8 digits

No download: the data is `jdist.datasets.synthetic` (random class prototypes
plus noise, CIFAR-10's shape) or sklearn's bundled digits. What this example
adds to mnist_cnn.py:

* BatchNorm's running statistics are per replica (each sees its own batch):
  `jdist.pmean` averages them every step, so every replica, and the saved
  model, holds the same statistics.
* CIFAR-style augmentation (`--augment`: random crops of a 4-pixel padding,
  horizontal flips) runs in `ShardedLoader`'s prefetch thread, off the
  training loop.
* A learning-rate schedule and weight decay inside `jdist.dist_opt`.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from jdist.app import datasets
from jdist.app import models


def augment(rng):
  """Random 4-pixel-padded crops and horizontal flips of a [devices, batch, H, W, C] batch."""
  def transform(batch):
    images = batch["x"]
    height, width = images.shape[2:4]
    padded = np.pad(images, ((0, 0), (0, 0), (4, 4), (4, 4), (0, 0)), mode="reflect")
    out = np.empty_like(images)
    for index in np.ndindex(images.shape[:2]):
      top, left = rng.integers(0, 9, size=2)
      crop = padded[index][top:top + height, left:left + width]
      out[index] = crop[:, ::-1] if rng.random() < 0.5 else crop
    return {**batch, "x": out}
  return transform


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="synthetic", choices=["synthetic", "digits"])
  parser.add_argument("--depth", type=int, default=8, choices=[8, 20, 32, 56])
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--batch-size", type=int, default=32, help="per replica")
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--num-train", type=int, default=2048, help="synthetic examples")
  parser.add_argument("--half", choices=["fp16", "bf16"], help="16-bit gradient exchange")
  parser.add_argument("--sparsify", help="e.g. topk:0.01 (with error feedback)")
  parser.add_argument("--augment", action="store_true",
                      help="random crops and flips (for real images: they scramble the "
                      "synthetic data's pixel-noise prototypes)")
  args = parser.parse_args()

  topo = jdist.init()
  if args.dataset == "synthetic":
    data = datasets.synthetic(args.num_train, 512, image_shape=(32, 32, 3), noise=0.6)
  else:
    data = datasets.load("digits")
  input_shape = data.train_x.shape[1:]
  model = models.create_model(f"resnet{args.depth}", num_classes=data.num_classes,
                              input_shape=input_shape)
  params, model_state = models.init_model(model, jax.random.key(topo.process_index), input_shape)
  params, model_state = jdist.broadcast_params((params, model_state))  # rank 0's everywhere

  train_loader = jdist.ShardedLoader(
      {"x": data.train_x, "y": data.train_y}, batch_size=args.batch_size, topology=topo,
      transform=augment(np.random.default_rng(topo.process_index)) if args.augment else None)
  test_loader = jdist.ShardedLoader({"x": data.test_x, "y": data.test_y}, batch_size=128,
                                    topology=topo, shuffle=False, drop_last=False,
                                    pad_with_weights=True)
  schedule = optax.cosine_decay_schedule(args.lr, args.epochs * len(train_loader))
  half = {None: False, "fp16": jnp.float16, "bf16": jnp.bfloat16}[args.half]
  tx = jdist.dist_opt(optax.chain(optax.add_decayed_weights(5e-4),
                                  optax.sgd(schedule, momentum=0.9)),
                      half=half, sparsify=args.sparsify)

  @jdist.data_parallel
  def train_step(params, model_state, opt_state, batch):
    def loss_fn(p):
      logits, new_state = models.apply_model(model, p, model_state, batch["x"], train=True)
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
      return losses.mean(), (losses, jnp.argmax(logits, -1) == batch["y"], new_state)
    grads, (losses, correct, new_state) = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    new_state = jdist.pmean(new_state)  # per-replica BatchNorm statistics -> their mean
    return (optax.apply_updates(params, updates), new_state, opt_state,
            jdist.metric_sums(losses, correct))

  @jdist.data_parallel
  def eval_step(params, model_state, batch):
    logits, _ = models.apply_model(model, params, model_state, batch["x"], train=False)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return jdist.metric_sums(losses, jnp.argmax(logits, -1) == batch["y"], batch["weight"])

  params, model_state = jdist.replicate(params), jdist.replicate(model_state)
  opt_state = jdist.data_parallel(tx.init)(params)
  if topo.is_primary:
    print(f"resnet{args.depth} ({models.param_count(jdist.unreplicate(params)):,} parameters) "
          f"on {data.name} {input_shape}: {len(data.train_x)} train / {len(data.test_x)} test; "
          f"{topo}", flush=True)
  for epoch in range(args.epochs):
    start, train_metrics, test_metrics = time.time(), jdist.MetricAccumulator(), jdist.MetricAccumulator()
    for batch in train_loader.epoch(epoch):
      params, model_state, opt_state, sums = train_step(params, model_state, opt_state, batch)
      train_metrics.add(sums)
    for batch in test_loader.epoch(0):
      test_metrics.add(eval_step(params, model_state, batch))
    train, test = train_metrics.result(), test_metrics.result()
    if topo.is_primary:
      print(f"epoch {epoch + 1}/{args.epochs}: train loss {train['loss']:.4f} acc "
            f"{train['accuracy']:.2%} | test loss {test['loss']:.4f} acc {test['accuracy']:.2%}"
            f" | {time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
  main()
