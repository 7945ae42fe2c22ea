"""Page faults of fresh XLA buffers: mpi4jax inside jit against raw MPI.

    bash scripts/mpirun.sh -np 2 .venv/bin/python -m benchmarks allocator
    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 \\
        bash scripts/mpirun.sh -np 2 -x MALLOC_MMAP_THRESHOLD_ -x MALLOC_TRIM_THRESHOLD_ \\
        .venv/bin/python -m benchmarks allocator

Every jitted call gets a new output buffer. glibc serves large ones with
mmap and hands them back on free (or trims them off the heap), so each call
page-faults its output in again, while raw MPI reuses one numpy buffer. The
two glibc variables above keep buffers up to 32 MiB in the heap. Prints, per
size, the median time per all-reduce and the minor page faults per
all-reduce of raw mpi4py `Allreduce` and of `mpi4jax.allreduce` in a jitted
function, one and eight (`*_x8`) per call.
"""

from __future__ import annotations

import argparse
import os
import resource

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import allreduce
from benchmarks import timing

SIZES_MB = (1, 4, 16, 64)


def _faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(args: argparse.Namespace) -> int:
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel
  import mpi4jax  # pylint: disable=import-outside-toplevel
  comm = allreduce.baseline_comm()
  one = lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)
  reduce, reduce_x8 = jax.jit(one), jax.jit(allreduce.chained(one))
  tuned = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc default")
  for megabytes in SIZES_MB:
    count = (megabytes << 20) // 4
    src = np.ones(count, np.float32)
    dst = np.empty_like(src)
    on_device = jnp.asarray(src)
    calls = {"mpi": (lambda: comm.Allreduce(src, dst, op=MPI.SUM), 1),
             "mpi_x8": (lambda: [comm.Allreduce(src, dst, op=MPI.SUM)
                                 for _ in range(allreduce.CHAIN)], allreduce.CHAIN),
             "mpi4jax": (lambda: reduce(on_device), 1),
             "mpi4jax_x8": (lambda: reduce_x8(on_device), allreduce.CHAIN)}
    faults = {name: 0 for name in calls}

    def counted(name, fn):
      def run():
        before = _faults()
        out = jax.block_until_ready(fn())
        faults[name] += _faults() - before
        return out
      return run

    repeats = timing.repeats_for(megabytes << 20, quick=False, least=7, most=30)
    series = timing.interleaved({name: counted(name, fn) for name, (fn, _) in calls.items()},
                                repeats=repeats, warmup=2, sync=comm.Barrier)
    if comm.Get_rank() == 0:
      cells = []
      for name, (_, per_call) in calls.items():
        total_calls = repeats + 2  # faults were counted in warm-up too
        cells.append(f"{name} {series[name].per(per_call).median * 1e3:.2f} ms "
                     f"{faults[name] / total_calls / per_call:.0f} faults")
      print(f"{megabytes} MB (MALLOC_MMAP_THRESHOLD_={tuned}): " + ", ".join(cells), flush=True)
  return 0
