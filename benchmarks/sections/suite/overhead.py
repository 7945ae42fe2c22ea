"""Suite part 2: what jdist adds to a train step against hand-written `pmap` and `shard_map`
steps (and without the inputs' check), interleaved step by step.
"""

from __future__ import annotations

import jax
import optax

import jdist
from benchmarks.harness import timing
from benchmarks.harness import workload

MODELS = ("mlp1m", "cnn")
QUICK_MODELS = ("mlp-tiny",)
PER_REPLICA_BATCH = 32
REPEATS = 60
LEARNING_RATE = 0.01


def measure(ctx, name: str) -> dict:
  """Interleaved jdist and hand-written pmap steps of model `name`."""
  bench = workload.setup(name, PER_REPLICA_BATCH)
  sgd = optax.sgd(LEARNING_RATE)
  jdist_tx = jdist.dist_opt(sgd)
  variants = {
      "jdist": bench.stepper(workload.jdist_step(bench.model, jdist_tx), jdist_tx),
      "pmap": bench.stepper(workload.pmap_step(bench.model, sgd), sgd, init=jax.pmap),
      "shard_map": bench.stepper(workload.shard_map_step(bench.model, sgd), sgd),
      "jdist_nocheck": bench.stepper(
          workload.jdist_step(bench.model, jdist_tx, check_inputs=False), jdist_tx),
  }
  series = timing.interleaved(variants, repeats=ctx.repeats(REPEATS), warmup=ctx.warmup(3),
                              sync=ctx.sync)
  return {"model": name, "params": bench.param_count, "devices": ctx.topo.local_device_count,
          "per_replica_batch": PER_REPLICA_BATCH, **series["jdist"].as_dict("jdist_"),
          **series["pmap"].as_dict("pmap_"), **series["jdist_nocheck"].as_dict("jdist_nocheck_"),
          **series["shard_map"].as_dict("shard_map_"),
          "paired_ratio": timing.paired_ratio(series["jdist"], series["pmap"]),
          "paired_ratio_shard_map": timing.paired_ratio(series["jdist"], series["shard_map"])}


NAME = "overhead"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  for name in QUICK_MODELS if ctx.quick else MODELS:
    yield measure(ctx, name)
