"""Fashion-MNIST (or the bundled digits) with grain as the input pipeline: jit steps, exact resume.

    python examples/mnist_grain.py                               # one process, every local device
    mpirun -np 2 python examples/mnist_grain.py                  # two processes
    python examples/mnist_grain.py --checkpoint-dir ckpt --stop-at-step 30   # "interrupted"...
    python examples/mnist_grain.py --checkpoint-dir ckpt                     # ...resumed exactly

`jdist.GrainLoader` builds each process's grain `DataLoader` from the
topology (process p reads shard p of the training set, `global_batch / P`
examples per step) and places its batches over `jdist.mesh()` for the jit
step. The checkpoint keeps every process's iterator position with the
parameters (`CheckpointManager.save(..., data_iterator=)`), so a resumed run
reads exactly the batches the uninterrupted run would have read and ends
with the same parameters.

Data: Fashion-MNIST where installed (Debian's dataset-fashion-mnist puts it
in /usr/share/datasets/fashion-mnist), else scikit-learn's 8x8 digits; no
download.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from jdist.app import datasets, models


def load(name):
  """The dataset asked for; with "auto", Fashion-MNIST if installed, else the digits."""
  if name != "auto":
    return datasets.load(name, download=False)
  try:
    return datasets.load("fashion_mnist", download=False)
  except datasets.DatasetError:
    return datasets.load("digits")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="auto", help="auto, fashion_mnist or digits")
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--batch-size", type=int, default=64, help="global: over all replicas")
  parser.add_argument("--lr", type=float, default=0.05)
  parser.add_argument("--workers", type=int, default=0, help="grain worker processes")
  parser.add_argument("--checkpoint-dir", help="save here; a run finding a checkpoint resumes")
  parser.add_argument("--checkpoint-every", type=int, default=10, help="steps")
  parser.add_argument("--stop-at-step", type=int, help="save and stop there (a stand-in for a "
                      "preempted job)")
  args = parser.parse_args()

  topo = jdist.init()                   # MPI under mpirun, else one process
  jax.set_mesh(jdist.mesh())            # jit steps over every device of the job
  data = load(args.dataset)
  model = models.create_model("cnn", num_classes=10, input_shape=data.train_x.shape[1:])
  params = model.init(jax.random.key(topo.process_index), data.train_x[:1])  # differs per rank...
  params = jdist.broadcast_params(params)                                   # ...so use rank 0's
  tx = jdist.dist_opt(optax.sgd(args.lr, momentum=0.9))
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: models.cross_entropy_loss(model.apply(p, batch["x"]), batch["y"]))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss)

  @jax.jit
  def accuracy(params, batch):  # every process holds as many test rows: the mean of means
    return jdist.pmean(jnp.mean(jnp.argmax(model.apply(params, batch["x"]), -1) == batch["y"]))

  # grain reads this process's shard, shuffled each epoch, global batches of --batch-size.
  loader = jdist.GrainLoader({"x": data.train_x, "y": data.train_y},
                             global_batch_size=args.batch_size, seed=0,
                             worker_count=args.workers)
  batches = iter(loader)
  steps = loader.steps_per_epoch * args.epochs
  test_rows = len(data.test_x) // topo.replica_count * topo.replica_count
  test = jdist.shard_global_batch({"x": data.test_x[:test_rows], "y": data.test_y[:test_rows]})

  manager = jdist.CheckpointManager(args.checkpoint_dir) if args.checkpoint_dir else None
  step = 0
  if manager is not None and manager.latest_step() is not None:
    state, meta = manager.restore({"params": params, "opt_state": opt_state},
                                  data_iterator=batches)  # every process's own position
    params, opt_state, step = state["params"], state["opt_state"], meta["step"]
    if topo.is_primary:
      print(f"resumed at step {step}", flush=True)
  if topo.is_primary:
    print(f"{data.name}: {len(data.train_x)} train / {test_rows} test; {topo.process_count} "
          f"processes x {topo.local_device_count} devices; {loader.steps_per_epoch} steps "
          f"per epoch of {args.batch_size}", flush=True)

  start, loss = time.time(), None
  while step < steps:
    params, opt_state, loss = train_step(params, opt_state, next(batches))
    step += 1
    stopping = step == args.stop_at_step
    if manager is not None and (step % args.checkpoint_every == 0 or stopping):
      manager.save(step, {"params": params, "opt_state": opt_state},
                   metadata={"step": step}, data_iterator=batches)
    if step % loader.steps_per_epoch == 0 and topo.is_primary:
      print(f"epoch {step // loader.steps_per_epoch}/{args.epochs}: loss {float(loss):.4f}, "
            f"test accuracy {float(accuracy(params, test)):.2%}, {time.time() - start:.1f} s",
            flush=True)
    elif step % loader.steps_per_epoch == 0:
      accuracy(params, test)  # a collective: every process takes part
    if stopping:
      break
  batches.close()
  if topo.is_primary and loss is not None:
    digest = sum(float(np.abs(np.asarray(leaf.addressable_data(0))).sum())
                 for leaf in jax.tree.leaves(params))
    print(f"stopped at step {step}: loss {float(loss):.6f}, parameter |sum| {digest:.6f}",
          flush=True)


if __name__ == "__main__":
  main()
