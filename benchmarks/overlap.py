"""Probe: can XLA:CPU overlap an mpi4jax all-reduce with the backward pass?

    python -m benchmarks overlap [--link 1gbit] [--repeats 15]

A 2x1 job (in a shaped namespace unless --link shm) on SINGA's CNN with 64
images per replica, measuring, interleaved round by round:

  * `grads`: the jitted loss gradient alone (forward + backward, no exchange);
    `step_local`: the same plus the SGD update (the compute-only step);
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
  * `step_async` (the prototype): the dense layers' gradients leave through a
    host callback that hands them to a background thread running a blocking
    mpi4py `Allreduce` and returns at once; a second callback, which needs the
    convolutions' gradients (so XLA runs it after the rest of the backward
    pass), waits for that thread, then all-reduces the convolutions'. If the
    step takes about max(grads, allreduce) rather than their sum, the
    exchange ran during the backward pass; `step_async_poll`: the same with
    `Iallreduce` polled by `Test` every 0.2 ms (the thread sleeps between
    polls instead of Open MPI's busy progress loop);
  * `stamps`: `step_buckets` with host timestamps (`jax.debug.callback`) when
    each bucket's gradients are ready and when its all-reduce returns: if the
    convolutions' gradients became ready before the dense all-reduce
    returned, the backward pass ran during the exchange.

With torch installed, `torch_compute` and `ddp` (benchmarks.torch_peer) run
in the same rounds, so exposed exchanges compare side by side.

The per-rank rows come back through `benchmarks.jobs` like any section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from benchmarks import timing
from benchmarks import workload
from jdist.app import models

PER_REPLICA_BATCH = 64
DENSE_LAYERS = ("Dense_0", "Dense_1")


def _split(grads):
  dense = {k: v for k, v in grads.items() if k in DENSE_LAYERS}
  conv = {k: v for k, v in grads.items() if k not in DENSE_LAYERS}
  return dense, conv


class AsyncAllreduce:
  """Host side of `step_async`: start an all-reduce on a thread, finish it later."""

  def __init__(self, comm, stamps: list, poll_s: float = 0.0):
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    self.comm = comm
    self.poll_s = poll_s  # 0: blocking Allreduce; else Iallreduce, Test, sleep poll_s
    self.stamps = stamps  # (event, perf_counter) of the last steps
    self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="allreduce")
    self.pending = {}
    self.count = 0

  def start(self, values):
    send = np.array(values, np.float32)
    recv = np.empty_like(send)
    self.count += 1
    self.stamps.append(("async_started", time.perf_counter()))

    def reduce():
      if self.poll_s:
        request = self.comm.Iallreduce(send, recv)
        while not request.Test():
          time.sleep(self.poll_s)
      else:
        self.comm.Allreduce(send, recv)
      self.stamps.append(("async_reduced", time.perf_counter()))

    self.pending[self.count] = (self.executor.submit(reduce), recv)
    return np.int32(self.count)

  def finish(self, key, rest):
    future, first = self.pending.pop(int(key))
    self.stamps.append(("async_finish_called", time.perf_counter()))
    future.result()
    rest_send = np.array(rest, np.float32)
    rest_recv = np.empty_like(rest_send)
    self.comm.Allreduce(rest_send, rest_recv)
    return first, rest_recv


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

  def step_async_with(exchange):
    def step_async(p):
      dense, conv = _split(grads_of(p))
      dense_flat, dense_back = ravel(dense)
      conv_flat, conv_back = ravel(conv)
      key = jax.pure_callback(exchange.start, jax.ShapeDtypeStruct((), jnp.int32), dense_flat)
      shapes = (jax.ShapeDtypeStruct(dense_flat.shape, jnp.float32),
                jax.ShapeDtypeStruct(conv_flat.shape, jnp.float32))
      dense_sum, conv_sum = jax.pure_callback(exchange.finish, shapes, key, conv_flat)
      averaged = {**dense_back(dense_sum / size), **conv_back(conv_sum / size)}
      return jax.tree.map(lambda p_, g: p_ - 0.01 * g, p, averaged)
    return jax.jit(step_async)

  buffer = jnp.ones(models.param_count(params), jnp.float32)
  return {
      "step_async": step_async_with(AsyncAllreduce(comm.Dup(), stamps)),
      "step_async_poll": step_async_with(AsyncAllreduce(comm.Dup(), stamps, poll_s=2e-4)),
      "grads": jax.jit(grads_of),
      "allreduce": jax.jit(lambda b: mpi4jax.allreduce(b, op=MPI.SUM, comm=comm)),
      "independent": jax.jit(lambda p, b: (grads_of(p),
                                           mpi4jax.allreduce(b, op=MPI.SUM, comm=comm))),
      "step_local": jax.jit(lambda p: jax.tree.map(lambda p_, g: p_ - 0.01 * g, p,
                                                   grads_of(p))),
      "step_fused": jax.jit(lambda p: jax.tree.map(lambda p_, g: p_ - 0.01 * g, p,
                                                   allreduce_tree(grads_of(p)))),
      "step_buckets": jax.jit(lambda p: buckets(p, False)),
      "stamps": jax.jit(lambda p: buckets(p, True)),
  }, buffer


def run(ctx):
  """Yields one row per probe (median seconds), then the timestamp offsets."""
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
           "step_local": lambda: probes["step_local"](params),
           "step_fused": lambda: probes["step_fused"](params),
           "step_buckets": lambda: probes["step_buckets"](params),
           "step_async": lambda: probes["step_async"](params),
           "step_async_poll": lambda: probes["step_async_poll"](params)}
  sgd = optax.sgd(0.01)
  for name, bucket_bytes in (("jdist_plain", 4 << 20), ("jdist_256k", 256 << 10)):
    tx = jdist.dist_opt(sgd, bucket_bytes=bucket_bytes)
    calls[name] = bench.stepper(workload.jdist_step(bench.model, tx), tx)
  if ctx.options.get("torch"):  # DDP beside it, same processes and rounds
    from benchmarks import network_steps  # pylint: disable=import-outside-toplevel
    calls.update(network_steps.torch_steppers(ctx, ["compute", "ddp"]))
  series = timing.interleaved(calls, repeats=repeats, warmup=3, sync=ctx.sync)
  for name, values in series.items():
    local = series["torch_compute" if name in ("ddp", "torch_compute") else "step_local"]
    exposed = statistics.median(a - b for a, b in zip(values.samples, local.samples))
    yield {"probe": name, **values.as_dict(), "exposed_paired_s": exposed}
  for probe in ("stamps", "step_async", "step_async_poll"):
    offsets = {}
    for _ in range(repeats):
      stamps.clear()
      ctx.sync()
      start = time.perf_counter()
      jax.block_until_ready(probes[probe](params))
      offsets.setdefault("returned", []).append(time.perf_counter() - start)
      for name, when in stamps:
        offsets.setdefault(name, []).append(when - start)
    yield {"probe": f"{probe} timeline", **{f"{name}_at_s": statistics.median(v)
                                            for name, v in offsets.items()}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--link", default="1gbit")
  parser.add_argument("--repeats", type=int, default=15)


def main(args: argparse.Namespace) -> int:
  from benchmarks import jobs as jobs_lib  # pylint: disable=import-outside-toplevel
  from benchmarks import netns  # pylint: disable=import-outside-toplevel
  link = netns.link_named(args.link)
  netns.terminate_on_sigterm()
  from benchmarks import network  # pylint: disable=import-outside-toplevel
  with_torch = network.torch_missing() is None
  env = network.gloo_env() if with_torch else ()
  job = jobs_lib.Job(f"overlap@{link.name}", 2, 1, ("overlap",), env=env,
                     options=(("repeats", args.repeats), ("torch", with_torch)))
  with network.link_namespace(link) as name:
    result = jobs_lib.run(network.in_namespace(job, name), quick=False, timeout=400)
  if "error" in result:
    print(result["error"], file=sys.stderr)
  for row in result.get("sections", {}).get("overlap", {}).get("rows", []):
    print(", ".join(f"{k} {v * 1e3:.1f} ms" if k.endswith("_s") else f"{k} {v}"
                    for k, v in row.items() if not k.endswith(("min_s", "p90_s"))))
  return 0 if "error" not in result else 1
