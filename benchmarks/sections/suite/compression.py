"""Suite part 3: bytes on the wire and step time of each compression mode, interleaved with a
`compute` step (communication = step - compute, the compressor's own work included).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from benchmarks.harness import timing
from benchmarks.harness import workload

MODELS = ("mlp1m", "mlp10m")
QUICK_MODELS = ("mlp-tiny",)
PER_REPLICA_BATCH = 16
LEARNING_RATE = 0.01
THRESHOLD_QUANTILE = 0.99  # threshold mode: the value only ~1% of entries pass
SPARSE_CAPACITY = 0.01  # threshold mode sends at most 1% of entries (as top-K 1%)

# name -> dist_opt keyword arguments (None: built by `transformation`).
MODES = {
    "plain": {},
    "fp16": {"half": jnp.float16},
    "bf16": {"half": jnp.bfloat16},
    "topk1%": {"sparsify": ("topk", 0.01)},
    "topk0.1%": {"sparsify": ("topk", 0.001)},
    "threshold": None,
    "partial4": {"partial": 4},
    "powersgd4": {"powersgd": 4},  # rank-4 factors of each matrix
    "powersgd1": {"powersgd": 1},  # the rank of the DDP PowerSGD hook beside it
    "topk1%-block": {"sparsify": "topk_block:0.01"},  # one-pass block selection
    "plain-4MB": {"bucket_bytes": 4 << 20},  # proposal: smaller fusion buckets
}
QUICK_MODES = ("plain", "fp16", "topk1%")


def threshold_value(bench: workload.Setup) -> float:
  """The |gradient| quantile of one fixed batch, the same on every rank."""
  x, y = workload.local_batch(1, PER_REPLICA_BATCH, seed=1)
  grads = jax.jit(lambda p: workload.loss_and_grads(bench.model, p, x[0], y[0])[1])(
      jdist.unreplicate(bench.params))
  flat = np.concatenate([np.abs(np.asarray(g)).ravel() for g in jax.tree.leaves(grads)])
  return float(np.quantile(flat, THRESHOLD_QUANTILE))


def transformation(mode: str, bench: workload.Setup) -> optax.GradientTransformation:
  """The gradient transformation + SGD that `mode` names."""
  sgd = optax.sgd(LEARNING_RATE)
  if mode == "threshold":
    return jdist.dist_opt(sgd, sparsify=("threshold", threshold_value(bench)),
                          threshold_capacity=SPARSE_CAPACITY)
  return jdist.dist_opt(sgd, **MODES[mode])



def measure(ctx, name: str) -> list[dict]:
  bench = workload.setup(name, PER_REPLICA_BATCH)
  sgd = optax.sgd(LEARNING_RATE)
  steppers = {"compute": bench.stepper(workload.compute_step(bench.model, sgd), sgd)}
  for mode in QUICK_MODES if ctx.quick else MODES:
    tx = transformation(mode, bench)
    steppers[mode] = bench.stepper(workload.jdist_step(bench.model, tx), tx)
  repeats = ctx.repeats(25 if bench.param_count < 5_000_000 else 11)
  series = timing.interleaved(steppers, repeats=repeats, warmup=ctx.warmup(2),
                              sync=ctx.sync)
  rows = []
  for mode, stepper in steppers.items():
    sent = jdist.wire_bytes(jdist.unreplicate(stepper.state[1]))
    rows.append({"model": name, "params": bench.param_count, "mode": mode,
                 "wire_bytes": float(sent), "per_replica_batch": PER_REPLICA_BATCH,
                 **series[mode].as_dict()})
  return rows


NAME = "compression"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  for name in QUICK_MODELS if ctx.quick else MODELS:
    yield from measure(ctx, name)
