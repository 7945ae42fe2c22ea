"""Suite part 1 (and 5): all-reduce time of float32 buffers, 4 KB to 64 MB, every variant
interleaved at each size (the variants and the method: docs/benchmarks/results.md).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from benchmarks.harness import analysis
from benchmarks.harness import timing
from jdist import collectives
from jdist.collectives import native

SIZES = tuple(4096 * 4**i for i in range(8))  # 4 KB .. 64 MB
# Smoke run: a small size and one above 256 KB, where the 2x2 callback route
# once deadlocked (XLA's CPU pool starved by MPI-blocked host callbacks).
QUICK_SIZES = (4096, 1 << 20)
CHAIN = 8  # all-reduces per call in the *_x8 variants


def chained(reduce: Callable, times: int = CHAIN) -> Callable:
  """`reduce` applied `times` times in a row, each on the previous result."""
  def run(x):
    for _ in range(times):
      x = reduce(x)
    return x
  return run


def on_route(route: str) -> Callable:
  """`jdist.psum` on `route` (as `jdist.init(route=route)` gives a whole job)."""
  return lambda x: collectives.on_route(route).psum(x)


def jdist_mean(dtype=None) -> Callable:
  """Per-replica `jdist.allreduce()` (after `jdist.cast(dtype)` if given)."""
  parts = ([jdist.cast(dtype)] if dtype is not None else []) + [jdist.allreduce()]
  tx = optax.chain(*parts)
  return lambda x: tx.update(x, tx.init(x))[0]


def _jdist_variants(topo: jdist.Topology) -> dict[str, tuple[Callable, str | None]]:
  """name -> (per-replica function, forced route or None)."""
  variants = {
      "jdist_noop": (lambda x: x + 1.0, None),
      "jdist_psum": (jdist.psum, None),
      "jdist_mean": (jdist_mean(), None),
      "jdist_fp16": (jdist_mean(jnp.float16), None),
      "jdist_psum_x8": (chained(jdist.psum), None),
  }
  # The callback route blocks an XLA thread per device, so with several
  # devices it needs the thread pool jdist.init() only enlarges for it: run
  # the job with NPROC=16 (the native route does not need it) to include it.
  callback_ok = topo.local_device_count == 1 or int(os.environ.get("NPROC", "0")) >= 8
  if topo.backend == "mpi" and topo.process_count > 1 and callback_ok:
    variants["jdist_callback"] = (on_route("callback"), "callback")
    variants["jdist_callback_x8"] = (chained(on_route("callback")), "callback")
    if topo.route != "native" and native.running():
      variants["jdist_native"] = (on_route("native"), "native")
      variants["jdist_native_x8"] = (chained(on_route("native")), "native")
    if topo.route == "native" and topo.local_device_count == 1:
      variants["jdist_mpi4jax"] = (on_route("mpi4jax"), "mpi4jax")
      variants["jdist_mpi4jax_x8"] = (chained(on_route("mpi4jax")), "mpi4jax")
  return variants


def _host_variants(topo: jdist.Topology, count: int) -> dict[str, Callable[[], Any]]:
  """The baselines: a memory copy, MPI on numpy buffers, mpi4jax in jit."""
  src = np.random.default_rng(0).random(count, dtype=np.float32)
  dst = np.empty_like(src)
  variants = {"memcpy": lambda: np.copyto(dst, src)}
  if topo.process_count == 1:
    return variants
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel
  comm = baseline_comm()
  variants["mpi"] = lambda: comm.Allreduce(src, dst, op=MPI.SUM)
  variants["mpi_x8"] = lambda: [comm.Allreduce(src, dst, op=MPI.SUM) for _ in range(CHAIN)]
  if topo.backend == "mpi" and topo.local_device_count == 1:
    import mpi4jax  # pylint: disable=import-outside-toplevel
    on_device = jnp.asarray(src)
    one = lambda x: mpi4jax.allreduce(x, op=MPI.SUM, comm=comm)
    reduce, reduce_x8 = jax.jit(one), jax.jit(chained(one))
    variants["mpi4jax"] = lambda: reduce(on_device)
    variants["mpi4jax_x8"] = lambda: reduce_x8(on_device)
  return variants


_comm = None


def baseline_comm():
  """A communicator of the benchmark's own, apart from jdist's."""
  global _comm
  if _comm is None:
    from mpi4py import MPI  # pylint: disable=import-outside-toplevel
    _comm = MPI.COMM_WORLD.Dup()
  return _comm


def measure_size(ctx, nbytes: int) -> list[dict]:
  """Every variant at one buffer size (float32, `nbytes` per replica)."""
  topo = ctx.topo
  count = nbytes // 4
  variants = _host_variants(topo, count)
  routes: dict[str, str] = {}
  buffer = jdist.replicate(jnp.ones((count,), jnp.float32))
  for name, (fn, route) in _jdist_variants(topo).items():
    step = jdist.data_parallel(fn)
    jax.block_until_ready(step(buffer))  # compiles on its route
    routes[name] = route or collectives.route()
    variants[name] = lambda step=step: step(buffer)
  series = timing.interleaved(variants, repeats=timing.repeats_for(nbytes, quick=ctx.quick),
                              warmup=ctx.warmup(2), sync=ctx.sync)
  rows = []
  for name, times in series.items():
    per_call = CHAIN if name.endswith("_x8") else 1
    # Host baselines reduce over one rank per process; jdist over every replica.
    participants = (1 if name in analysis.NO_EXCHANGE else
                    topo.replica_count if name in routes else topo.process_count)
    rows.append({"variant": name, "route": routes.get(name, "host"), "bytes": nbytes,
                 "replicas": topo.replica_count, "participants": participants,
                 "processes": topo.process_count,
                 "backend": topo.backend, "per_call": per_call,
                 **times.per(per_call).as_dict()})
  return rows


NAME = "allreduce"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  """Yields a row per variant and size, smallest sizes first."""
  for nbytes in QUICK_SIZES if ctx.quick else SIZES:
    yield from measure_size(ctx, nbytes)
