"""Profile of the 16-bit all-reduce: where its time goes, and the proposed fix.

In the 2x1 job (mpi4jax route), for float32 buffers of 16 MB and 64 MB,
interleaved:

  * `jdist_f32`, `jdist_fp16`: `jdist.allreduce()` without / after
    `jdist.cast(float16)`, in a `jdist.data_parallel` step;
  * `proposed_fp16`: the same 16-bit exchange written directly
    (`proposals.fp16_allreduce_mpi4jax`), in the same kind of step;
  * the pieces of the 16-bit route, each alone: `cast` (pre-scale and cast
    to float16), `alltoall16` and `allgather16` (the two exchanges, mpi4jax
    on uint16), `add_rows` (the float32 accumulation of the [P, n/P] rows,
    jdist's since 6e0c252) and `sum_axis0` (the one before), `decast` (back
    to float32, rescaled).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import jdist
from benchmarks.harness import timing
from benchmarks.sections.suite import allreduce
from benchmarks.sections.suite import proposals

SIZES = (16 << 20, 64 << 20)
QUICK_SIZES = (1 << 20,)


def _pieces(count: int, processes: int, comm) -> dict:
  """name -> (jitted function, its argument): the 16-bit route piece by piece."""
  import mpi4jax  # pylint: disable=import-outside-toplevel
  x = jnp.ones((count,), jnp.float32)
  half = x.astype(jnp.float16)
  bits = lax.bitcast_convert_type(half.reshape(processes, -1), jnp.uint16)
  rows = half.reshape(processes, -1)
  return {
      "cast": (jax.jit(lambda v: (v * (1.0 / processes)).astype(jnp.float16)), x),
      "alltoall16": (jax.jit(lambda b: mpi4jax.alltoall(b, comm=comm)), bits),
      "sum_axis0": (jax.jit(proposals.sum_rows_axis0), rows),
      "add_rows": (jax.jit(proposals.add_rows), rows),
      "allgather16": (jax.jit(lambda b: mpi4jax.allgather(b, comm=comm)), bits[0]),
      "decast": (jax.jit(lambda h: h.astype(jnp.float32) * float(processes)), half),
  }


def measure_size(ctx, nbytes: int) -> list[dict]:
  count = nbytes // 4
  comm = allreduce.baseline_comm()
  buffer = jdist.replicate(jnp.ones((count,), jnp.float32))
  steps = {
      "jdist_f32": jdist.data_parallel(allreduce.jdist_mean()),
      "jdist_fp16": jdist.data_parallel(allreduce.jdist_mean(jnp.float16)),
      "proposed_fp16": jdist.data_parallel(
          lambda v: proposals.fp16_allreduce_mpi4jax(v, comm)),
  }
  calls = {name: (lambda step=step: step(buffer)) for name, step in steps.items()}
  for name, (fn, arg) in _pieces(count, ctx.topo.process_count, comm).items():
    calls[name] = lambda fn=fn, arg=arg: fn(arg)
  series = timing.interleaved(calls, repeats=ctx.repeats(7), warmup=ctx.warmup(2),
                              sync=ctx.sync)
  return [{"bytes": nbytes, "piece": name, **times.as_dict()} for name, times in series.items()]


NAME = "half"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  """Yields a row per piece and size (needs one device per process, backend mpi)."""
  if ctx.topo.local_device_count != 1 or ctx.topo.backend != "mpi":
    raise ValueError("the 16-bit profile runs in a job with one device per process "
                     "(the mpi4jax route).")
  for nbytes in QUICK_SIZES if ctx.quick else SIZES:
    yield from measure_size(ctx, nbytes)
