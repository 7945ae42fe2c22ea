"""Worker measurement "cluster_allreduce": all-reduce across the rig's nodes, interleaved at each
float32 size of option `sizes`: `mpi`, `hierarchical` (by hand), `jdist_psum`, `jdist_flat`.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jdist
from benchmarks.harness import timing
from benchmarks.sections.suite import allreduce
from jdist import collectives
from jdist.collectives import native

VARIANTS = ("mpi", "hierarchical", "jdist_psum", "jdist_flat")
SECONDS = 3.0  # target timed seconds per variant and size
MOST_REPEATS = 15


def repeats_for(calls: dict[str, Callable[[], object]], seconds: float, quick: bool) -> int:
  """Runs one untimed round of `calls`; the timed rounds (3 to `MOST_REPEATS`) that take about
  `seconds` per variant at the slowest rank's pace (every rank agrees).
  """
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  for call in calls.values():
    jax.block_until_ready(call())
  elapsed = allreduce.baseline_comm().allreduce(time.perf_counter() - start, op=MPI.MAX)
  if quick:
    return 3
  per_call = elapsed / max(1, len(calls))
  return int(max(3, min(MOST_REPEATS, seconds // max(per_call, 1e-6))))


class Hierarchical:
  """Node-aware all-reduce in mpi4py over `comm` (equal nodes): reduce-scatter in the node,
  all-reduce of each slice across nodes, all-gather in the node; `count` float32 per rank.
  """

  def __init__(self, comm, count: int):
    from mpi4py import MPI  # pylint: disable=import-outside-toplevel
    self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local = self.node.Get_rank()
    self.cross = comm.Split(color=local, key=comm.Get_rank())
    sizes = comm.allgather(self.node.Get_size())
    if len(set(sizes)) != 1 or count % self.node.Get_size():
      raise ValueError(f"hierarchical all-reduce needs equal nodes and a count divisible by "
                       f"the ranks per node: ranks per node {sizes}, count {count}.")
    self.part = np.empty(count // self.node.Get_size(), np.float32)
    self.sum = MPI.SUM
    self.in_place = MPI.IN_PLACE

  @property
  def nodes(self) -> int:
    return self.cross.Get_size()

  def __call__(self, src: np.ndarray, dst: np.ndarray) -> None:
    self.node.Reduce_scatter_block(src, self.part, op=self.sum)
    self.cross.Allreduce(self.in_place, self.part, op=self.sum)
    self.node.Allgather(self.part, dst)

  def free(self) -> None:
    self.cross.Free()
    self.node.Free()


def flat(call: Callable[[], object]) -> object:
  """`call` with the native engine's sums flat, waited for, then node-aware again."""
  previous = native.set_hierarchical(False)
  try:
    return jax.block_until_ready(call())
  finally:
    native.set_hierarchical(previous)


def variants_at(count: int, names) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
  """The variants at `count` float32 elements per rank, and a function freeing them."""
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel
  comm = allreduce.baseline_comm()
  src = np.random.default_rng(comm.Get_rank()).random(count, dtype=np.float32)
  dst_mpi, dst_hier = np.empty_like(src), np.empty_like(src)
  calls: dict[str, Callable[[], object]] = {}
  hier = Hierarchical(comm, count)
  if "mpi" in names or "hierarchical" in names:
    comm.Allreduce(src, dst_mpi, op=MPI.SUM)
  if "mpi" in names:
    calls["mpi"] = lambda: comm.Allreduce(src, dst_mpi, op=MPI.SUM)
  if "hierarchical" in names:
    hier(src, dst_hier)
    if not np.allclose(dst_hier, dst_mpi, rtol=1e-5):
      raise AssertionError("the hierarchical all-reduce disagrees with MPI_Allreduce")
    calls["hierarchical"] = lambda: hier(src, dst_hier)
  if "jdist_psum" in names or "jdist_flat" in names:
    buffer = jdist.replicate(jnp.asarray(src))
    step = jdist.data_parallel(jdist.psum)
    jax.block_until_ready(step(buffer))  # compiles
    if "jdist_psum" in names:
      calls["jdist_psum"] = lambda: step(buffer)
    if "jdist_flat" in names and native.hierarchical():
      calls["jdist_flat"] = lambda: flat(lambda: step(buffer))
  return calls, hier.free


NAME = "cluster_allreduce"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  """Yields one row per variant and size, smallest size first."""
  names = tuple(ctx.options.get("variants", VARIANTS))
  seconds = float(ctx.options.get("seconds", SECONDS))
  for nbytes in ctx.options["sizes"]:
    count = nbytes // 4
    calls, free = variants_at(count, names)
    repeats = repeats_for(calls, seconds, ctx.quick)  # also the warm-up round
    series = timing.interleaved(calls, repeats=repeats, warmup=0, sync=ctx.sync)
    free()
    route = collectives.route() if "jdist_psum" in calls else None
    for name, times in series.items():
      yield {"variant": name, "route": route if name.startswith("jdist") else "host",
             "bytes": nbytes, "processes": ctx.topo.process_count, "nodes": ctx.topo.node_count,
             "replicas": ctx.topo.replica_count, "node_aware": native.hierarchical(),
             **times.as_dict()}
