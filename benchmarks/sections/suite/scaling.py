"""Suite part 4: training throughput as replicas are added (weak scaling), beside the step's
compute part.
"""

from __future__ import annotations

import optax

import jdist
from benchmarks.harness import timing
from benchmarks.harness import workload

MODEL = "cnn"
QUICK_MODEL = "mlp-tiny"
PER_REPLICA_BATCH = 32
REPEATS = 30
LEARNING_RATE = 0.01


NAME = "scaling"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  name = QUICK_MODEL if ctx.quick else MODEL
  bench = workload.setup(name, PER_REPLICA_BATCH)
  sgd = optax.sgd(LEARNING_RATE)
  tx = jdist.dist_opt(sgd)  # plain averaging
  steppers = {"step": bench.stepper(workload.jdist_step(bench.model, tx), tx),
              "compute": bench.stepper(workload.compute_step(bench.model, sgd), sgd)}
  series = timing.interleaved(steppers, repeats=ctx.repeats(REPEATS),
                              warmup=ctx.warmup(3), sync=ctx.sync)
  topo = ctx.topo
  yield {"model": name, "params": bench.param_count, "per_replica_batch": PER_REPLICA_BATCH,
         "processes": topo.process_count, "devices": topo.local_device_count,
         "replicas": topo.replica_count, **series["step"].as_dict(),
         **series["compute"].as_dict("compute_")}
