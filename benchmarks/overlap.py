"""Probe: can XLA:CPU overlap an mpi4jax all-reduce with the backward pass?

    python -m benchmarks.overlap [--link 1gbit] [--repeats 15]

A 2x1 job (in a shaped namespace unless --link shm) on SINGA's CNN with 64
images per replica, measuring, interleaved round by round:

  * `grads`: the jitted loss gradient alone (forward + backward, no exchange);
  * `allreduce`: one jitted `mpi4jax.allreduce` of 431,080 float32 alone;
  * `independent`: both in one jitted call with no data dependency between
    them: about max(grads, allreduce) if XLA runs them concurrently, about
    their sum if it runs them one after the other;
  * `step_fused`: a hand-written step, one all-reduce of every gradient
    (what jdist's fusion does for a model under one 4 MiB bucket);
  * `step_buckets`: the same step with two all-reduces, the dense layers'
    gradients (93% of the bytes, ready early in the backward pass) first,
    then the convolutions' (ready last), as DDP buckets them;
  * `jdist_plain`, `jdist_256k`: `jdist.dist_opt` with its default 4 MiB
    buckets and with 256 KiB ones (several exchanges per step);
  * `stamps`: `step_buckets` with host timestamps (`jax.debug.callback`) when
    each bucket's gradients are ready and when its all-reduce returns: if the
    convolutions' gradients became ready before the dense all-reduce
    returned, the backward pass ran during the exchange.

The per-rank rows come back through `benchmarks.jobs` like any section.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from benchmarks import timing
from benchmarks import workload

PER_REPLICA_BATCH = 64
DENSE_LAYERS = ("Dense_0", "Dense_1")


def _split(grads):
  dense = {k: v for k, v in grads.items() if k in DENSE_LAYERS}
  conv = {k: v for k, v in grads.items() if k not in DENSE_LAYERS}
  return dense, conv


def _probes(model, params, x, y, comm, stamps: list):
  import mpi4jax  # pylint: disable=import-outside-toplevel
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel
  size = comm.Get_size()
  ravel = jax.flatten_util.ravel_pytree

  def allreduce_tree(tree):
    flat, unravel = ravel(tree)
    return unravel(mpi4jax.allreduce(flat, op=MPI.SUM, comm=comm) / size)

  def grads_of(p):
    return workload.loss_and_grads(model, p, x, y)[1]

  def stamp(name, value):
    jax.debug.callback(lambda v: stamps.append((name, time.perf_counter())), value)

  def buckets(p, with_stamps):
    dense, conv = _split(grads_of(p))
    if with_stamps:
      stamp("dense_ready", jax.tree.leaves(dense)[0][..., :1])
      stamp("conv_ready", jax.tree.leaves(conv)[0][..., :1])
    dense = allreduce_tree(dense)
    if with_stamps:
      stamp("dense_reduced", jax.tree.leaves(dense)[0][..., :1])
    conv = allreduce_tree(conv)
    if with_stamps:
      stamp("conv_reduced", jax.tree.leaves(conv)[0][..., :1])
    return jax.tree.map(lambda p_, g: p_ - 0.01 * g, p, {**dense, **conv})

  buffer = jnp.ones(workload.param_count(params), jnp.float32)
  return {
      "grads": jax.jit(grads_of),
      "allreduce": jax.jit(lambda b: mpi4jax.allreduce(b, op=MPI.SUM, comm=comm)),
      "independent": jax.jit(lambda p, b: (grads_of(p),
                                           mpi4jax.allreduce(b, op=MPI.SUM, comm=comm))),
      "step_fused": jax.jit(lambda p: jax.tree.map(lambda p_, g: p_ - 0.01 * g, p,
                                                   allreduce_tree(grads_of(p)))),
      "step_buckets": jax.jit(lambda p: buckets(p, False)),
      "stamps": jax.jit(lambda p: buckets(p, True)),
  }, buffer


def run(ctx):
  """Yields one row per probe (median seconds), then the timestamp offsets."""
  import jax.flatten_util  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel
  repeats = 3 if ctx.quick else int(ctx.options.get("repeats", 15))
  bench = workload.setup("cnn", PER_REPLICA_BATCH)
  params = jdist.unreplicate(bench.params)
  x, y = (jnp.asarray(a[0]) for a in bench.batch)
  stamps: list = []
  probes, buffer = _probes(bench.model, params, x, y, MPI.COMM_WORLD.Clone(), stamps)
  calls = {"grads": lambda: probes["grads"](params),
           "allreduce": lambda: probes["allreduce"](buffer),
           "independent": lambda: probes["independent"](params, buffer),
           "step_fused": lambda: probes["step_fused"](params),
           "step_buckets": lambda: probes["step_buckets"](params)}
  sgd = optax.sgd(0.01)
  for name, bucket_bytes in (("jdist_plain", 4 << 20), ("jdist_256k", 256 << 10)):
    tx = jdist.dist_opt(sgd, bucket_bytes=bucket_bytes)
    calls[name] = bench.stepper(workload.jdist_step(bench.model, tx), tx)
  series = timing.interleaved(calls, repeats=repeats, warmup=3, sync=ctx.sync)
  for name, values in series.items():
    yield {"probe": name, **values.as_dict()}
  offsets = {}
  for _ in range(repeats):
    stamps.clear()
    ctx.sync()
    start = time.perf_counter()
    jax.block_until_ready(probes["stamps"](params))
    for name, when in stamps:
      offsets.setdefault(name, []).append(when - start)
  yield {"probe": "stamps", **{f"{name}_at_s": statistics.median(v)
                               for name, v in offsets.items()}}


def main(argv=None) -> int:
  from benchmarks import jobs as jobs_lib  # pylint: disable=import-outside-toplevel
  from benchmarks import netns  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--link", default="1gbit")
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args(argv)
  link = netns.link_named(args.link)
  netns.terminate_on_sigterm()
  job = jobs_lib.Job(f"overlap@{link.name}", 2, 1, ("overlap",),
                     options=(("repeats", args.repeats),))
  with (netns.shaped_namespace(link) if link.shaped else contextlib.nullcontext()) as name:
    if name:
      job = dataclasses.replace(job, prefix=tuple(netns.exec_prefix(name)),
                                mpirun_args=netns.MPI_TCP_ARGS)
    result = jobs_lib.run(job, quick=False, timeout=400)
  if "error" in result:
    print(result["error"], file=sys.stderr)
  for row in result.get("sections", {}).get("overlap", {}).get("rows", []):
    print(", ".join(f"{k} {v * 1e3:.1f} ms" if k.endswith("_s") else f"{k} {v}"
                    for k, v in row.items() if not k.endswith(("min_s", "p90_s"))))
  return 0 if "error" not in result else 1


if __name__ == "__main__":
  sys.exit(main())
