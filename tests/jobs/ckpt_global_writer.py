"""Jit-style (global) states for test_checkpoint.py, and a writer of them from another world.

  python tests/jobs/ckpt_global_writer.py DIR   # 1 process x N devices (N from XLA_FLAGS)
      DIR/nnx: step 3 of an NNX model and optimizer trained 2 jit steps, with
      the digest of every leaf in its metadata.
"""

import hashlib
import sys

import jax
import numpy as np
import optax
from flax import nnx

import jdist
from jdist.checkpoint.manager import CheckpointManager

ROWS_PER_REPLICA = 2


class Net(nnx.Module):
  """Params, batch statistics (per process in a jit step) and a dropout key stream."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(6, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.linear2 = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.linear2(self.dropout(nnx.relu(self.norm(self.linear1(x)))))


def nnx_objects(sparsify=None):
  """A fresh model and its nnx.Optimizer over jdist.dist_opt(adamw)."""
  model = Net(nnx.Rngs(0, dropout=1))
  tx = jdist.dist_opt(optax.adamw(0.01), **({"sparsify": sparsify} if sparsify else {}))
  return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def nnx_state(model, optimizer):
  return {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}


@nnx.jit
def _step(model, optimizer, x, y):
  def loss_fn(m):
    return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
  optimizer.update(model, nnx.grad(loss_fn)(model))


def train(model, optimizer, steps, seed=0):
  """`steps` jit steps on global batches of 2 rows per replica."""
  count = jdist.init().replica_count * ROWS_PER_REPLICA
  with jax.set_mesh(jdist.mesh()):
    for s in range(steps):
      rng = np.random.default_rng(seed * 100 + s)
      x = rng.normal(size=(count, 6)).astype(np.float32)
      y = rng.integers(0, 3, size=count).astype(np.int32)
      _step(model, optimizer, *jdist.shard_global_batch((x, y)))


def digest(tree) -> str:
  """A digest of every leaf's bytes (keys as key data), this process's copy."""
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return h.hexdigest()


def main(directory: str) -> None:
  topo = jdist.init()
  model, optimizer = nnx_objects()
  train(model, optimizer, 2)
  state = nnx_state(model, optimizer)
  CheckpointManager(f"{directory}/nnx").save(3, state, metadata={"digest": digest(state)})
  print(f"WROTE {topo.replica_count} replicas", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
