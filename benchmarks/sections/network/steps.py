"""Worker measurement "network": on SINGA's CNN, interleaved round by round, `compute`, jdist's
modes, `handwritten` (raw mpi4jax), the torch peer's variants (option `torch`), then `mpi_f32`.
"""

from __future__ import annotations

import statistics

import jax
import numpy as np
import optax

import jdist
from benchmarks.harness import analysis
from benchmarks.harness import timing
from benchmarks.harness import workload
from benchmarks.sections.suite import compression
from jdist.runtime import host

MODEL = "cnn"
PER_REPLICA_BATCH = 64
LEARNING_RATE = compression.LEARNING_RATE
MODES = ("plain", "fp16", "bf16", "topk1%", "topk1%-block", "threshold", "partial4",
         "powersgd4", "powersgd1")
REPEATS = 15
WARMUP = 3
# Each row's step against these, round by round (the torch peer's when present).
PAIRED_REFERENCES = ("compute", "torch_compute", "ddp", "ddp_fp16")


def mpi_floor(ctx, param_count: int, repeats: int, warmup: int) -> dict:
  """Raw mpi4py Allreduce of the gradient's float32 bytes (`mpi_f32`)."""
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel
  send, recv = np.ones(param_count, np.float32), np.empty(param_count, np.float32)
  series = timing.interleaved(
      {"mpi_f32": lambda: MPI.COMM_WORLD.Allreduce(send, recv, op=MPI.SUM)},
      repeats=repeats, warmup=warmup, sync=ctx.sync)
  return {"variant": "mpi_f32", "kind": "floor", "params": param_count,
          "wire_bytes": float(param_count * 4), **series["mpi_f32"].as_dict()}


def torch_steppers(ctx, variants) -> dict:
  """The PyTorch peer's variants as step functions, named `torch_compute`, `ddp`, ..."""
  from benchmarks.harness import torch_peer  # pylint: disable=import-outside-toplevel
  torch_peer.init(ctx.rank, ctx.topo.process_count)
  batch = PER_REPLICA_BATCH * ctx.topo.local_device_count
  return {("torch_compute" if v == "compute" else v):
          torch_peer.Trainer(v, batch, seed=0, rank=ctx.rank) for v in variants}


def slowest_compute(series: dict[str, timing.Series]) -> dict[str, list[float]]:
  """Round by round, the slowest process's compute-only step."""
  mine = {name: series[name].samples for name in ("compute", "torch_compute") if name in series}
  every = host.allgather_object(mine, "network: compute steps per round")
  return {name: analysis.slowest_per_round([rank[name] for rank in every]) for name in mine}


NAME = "network"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  """Yields one row per variant: median step time (`time_s`) and its spread."""
  repeats = 3 if ctx.quick else int(ctx.options.get("repeats", REPEATS))
  warmup = 1 if ctx.quick else int(ctx.options.get("warmup", WARMUP))
  modes = ctx.options.get("modes", MODES)
  bench = workload.setup(ctx.options.get("model", MODEL), PER_REPLICA_BATCH)
  sgd = optax.sgd(LEARNING_RATE)
  steppers = {"compute": bench.stepper(workload.compute_step(bench.model, sgd), sgd)}
  kinds = {"compute": "compute"}
  for mode in modes:
    tx = compression.transformation(mode, bench)
    steppers[mode] = bench.stepper(workload.jdist_step(bench.model, tx), tx)
    kinds[mode] = "jdist"
  if ctx.topo.local_device_count == 1 and ctx.topo.process_count > 1 and \
      ctx.options.get("handwritten", True):
    from mpi4py import MPI  # pylint: disable=import-outside-toplevel
    step = workload.mpi4jax_step(bench.model, sgd, MPI.COMM_WORLD.Clone())
    steppers["handwritten"] = bench.stepper(jax.pmap(step, axis_name="i"), sgd,
                                            init=jax.pmap)
    kinds["handwritten"] = "handwritten"
  if ctx.options.get("torch"):
    for name, trainer in torch_steppers(ctx, ctx.options["torch"]).items():
      steppers[name] = trainer
      kinds[name] = "torch"
  series = timing.interleaved(steppers, repeats=repeats, warmup=warmup, sync=ctx.sync)
  slowest = slowest_compute(series)
  for name, stepper in steppers.items():
    own = "torch_compute" if kinds[name] == "torch" else "compute"
    compute = series[own].samples
    wire = 0.0
    if kinds[name] == "jdist":
      wire = float(jdist.wire_bytes(jdist.unreplicate(stepper.state[1])))
    elif kinds[name] == "handwritten":
      wire = float(bench.param_count * 4)
    paired = statistics.median(s - c for s, c in zip(series[name].samples, compute))
    vs_slowest = statistics.median(s - c for s, c in zip(series[name].samples, slowest[own]))
    extra = {"threads": stepper.threads} if kinds[name] == "torch" else {}
    for reference in PAIRED_REFERENCES:  # medians of per-round ratios: drift cancels
      if reference in series:
        extra[f"paired_vs_{reference}"] = timing.paired_ratio(series[name], series[reference])
    yield {"variant": name, "kind": kinds[name], "params": bench.param_count, **extra,
           "per_replica_batch": PER_REPLICA_BATCH, "wire_bytes": wire,
           "comm_paired_s": paired, "comm_vs_slowest_s": vs_slowest,
           **series[name].as_dict()}
  if ctx.topo.process_count > 1 and ctx.options.get("floor", True):
    yield mpi_floor(ctx, bench.param_count, max(repeats, 10), warmup)
