"""A jit-style job (README's quickstart) with one mistake (tests/test_jit_checks.py).

--fault batch: rank 1 passes 48-row global batches, rank 0 64-row ones.
--fault batch_later: rank 1's global batch shrinks to 48 rows at step 3 only.
--fault params: parameters seeded per rank, never broadcast.
--fault none: a correct job.
Each step prints "jdist-job: rank R step N"; the end prints "jdist-job: done".
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdist  # noqa: E402


def _loss(params, batch):
  logits = batch["x"] @ params["w"] + params["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--fault", default="none")
  parser.add_argument("--timeout", type=float, default=10.0)
  parser.add_argument("--steps", type=int, default=6)
  args = parser.parse_args()
  topo = jdist.init(timeout=args.timeout)
  jax.set_mesh(jdist.mesh())
  key = jax.random.key(topo.process_index if args.fault == "params" else 0)
  params = {"w": jax.random.normal(key, (16, 4)) * 0.1, "b": jnp.zeros((4,))}
  if args.fault != "params":
    params = jdist.broadcast_params(params)
  tx = jdist.dist_opt(optax.sgd(0.1))
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss)

  rng = np.random.default_rng(0)
  for step in range(1, args.steps + 1):
    rows = 64
    if topo.process_index == 1 and (args.fault == "batch" or
                                    (args.fault == "batch_later" and step == 3)):
      rows = 48
    batch = {"x": rng.normal(size=(rows, 16)).astype(np.float32),
             "y": rng.integers(0, 4, size=rows).astype(np.int32)}
    params, opt_state, loss = train_step(params, opt_state, jdist.shard_global_batch(batch))
    print(f"jdist-job: rank {topo.process_index} step {step}", file=sys.stderr, flush=True)
  print(f"jdist-job: done rank {topo.process_index} loss {float(loss):.4f}", file=sys.stderr,
        flush=True)


if __name__ == "__main__":
  main()
