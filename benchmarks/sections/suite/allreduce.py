"""Section 1 (and 5): all-reduce time of float32 buffers, 4 KB to 64 MB.

Variants, interleaved at each size in one job:
  * `memcpy`: `np.copyto` of the buffer, the machine's memory limit;
  * `mpi`: mpi4py `Allreduce` on numpy buffers, the MPI floor;
  * `mpi4jax`: `mpi4jax.allreduce` in a jitted function (one device only);
  * `jdist_psum`: `jdist.psum` inside `jdist.data_parallel`, whatever route
    the topology picks (mpi4jax with one device per process, the callback
    route with several, XLA/gloo under backend "jax");
  * `jdist_mean`: the `jdist.allreduce()` transformation (sum, then divide);
  * `jdist_fp16`: `jdist.cast(float16)` + `jdist.allreduce()`: 16 bits on
    the wire, float32 in and out;
  * `jdist_callback`: `jdist.psum` on the callback route
    (`jdist.collectives.on_route`), the fallback where the native library is not
    built (with several devices per process, `jdist_psum` takes the native
    route: the two side by side);
  * `jdist_native`: `jdist.psum` on the native route
    (`jdist.collectives.on_route`) on one device per process, beside mpi4jax;
  * `jdist_noop`: the same kind of step with no exchange, `x + 1`: what
    any jitted call that returns a fresh buffer of that size costs (launch,
    a new output's page faults, one pass), the floor of the one-per-call
    variants above, which raw MPI on a reused numpy buffer does not pay;
  * `*_x8` (`mpi_x8`, `mpi4jax_x8`, `jdist_psum_x8`, `jdist_callback_x8`,
    `jdist_native_x8`): eight all-reduces, one
    after the other, per call (a Python loop for MPI, one jitted step for the
    others). Their time is per all-reduce: what one all-reduce costs inside a
    step, with the fixed cost of launching a jitted call (about 0.5 ms here,
    paid once per training step and measured by the step-overhead section)
    spread over the eight.

Rows hold the buffer size per replica (`bytes`), the replica count, the
ranks taking part in the variant's all-reduce (`participants`: every replica
for jdist, one rank per process for MPI and mpi4jax, 1 for memcpy) and the
median time; bandwidths are computed by the driver (`analysis`).
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
