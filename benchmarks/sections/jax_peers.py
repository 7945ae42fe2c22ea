"""jdist against what a JAX user writes instead: plain JAX multi-controller and hand-written mpi4jax.

    sudo .venv/bin/python -m benchmarks jax_peers [--rounds 5] [--topologies 2x1,2x2]
    sudo .venv/bin/python -m benchmarks jax_peers --on shaped --link 1gbit
    sudo .venv/bin/python -m benchmarks jax_peers --on rig [--rig-rate 1000]
    sudo .venv/bin/python -m benchmarks jax_peers --mpiwrapper PATH/libmpiwrapper.so  # + XLA's MPI

Each round runs two jobs back to back: `jdist` (`jdist_jit`, `jdist_dp`, `mpi4jax`, `floor`,
`sync_floor`, interleaved) and `gloo` (`jax_gloo`: XLA's all-reduce over Gloo), and with
`--mpiwrapper` a third, `mpi` (`jax_mpi`, one device per process). Reported: step medians and
paired ratios, 16 MiB all-reduces, loopback bytes per step and the losses after 20 steps
(which must agree). The variants and the runs: docs/jax_processes.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from typing import Any, Callable, Iterator

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jdist
from benchmarks.harness import jobs, netns, outputs, timing, workload
from benchmarks.harness import report as benchmarks_report
from benchmarks.harness.section import Run, UsageError, section
from jdist.app import models

NAME = "jax_peers"
LEARNING_RATE = 0.01
LOSS_STEPS = 20
BYTE_STEPS = 10
ALLREDUCE_BYTES = 16 << 20
LOSS_TOLERANCE = 1e-5
JOB_TIMEOUT = 900
JDIST_VARIANTS = ("jdist_jit", "jdist_dp")
PEERS = ("mpi4jax", "jax_gloo", "jax_mpi", "floor", "sync_floor")
# JAX's CPU collectives each plain-JAX job kind asks for, and its variants' prefix.
XLA_KINDS = {"gloo": "jax_gloo", "mpi": "jax_mpi"}


def _lo_bytes() -> int:
  """Bytes received on the loopback so far (each byte sent on it is received once)."""
  with open("/proc/net/dev", encoding="utf-8") as f:
    for line in f:
      name, _, rest = line.partition(":")
      if name.strip() == "lo":
        return int(rest.split()[0])
  return 0


def _sync_floor_step(model, tx):
  """The compute floor plus one 4-byte `jdist.pmean` that waits for every gradient leaf: the
  least any data-parallel step pays (every rank's compute, then one collective's latency).
  """
  def step(params, opt_state, x, y):
    loss, grads = workload.loss_and_grads(model, params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    # x * 0 is not folded away for floats (NaN), so the exchange waits for every leaf.
    after_all = sum(jax.numpy.sum(leaf) for leaf in jax.tree.leaves(grads)) * 0.0
    return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss + after_all)

  return jdist.data_parallel(step)


def _jdist_job(ctx, model, params, x, y) -> tuple[dict, dict]:
  """The jdist job's steps and all-reduces: name -> (stepper factory, host params of a stepper)."""
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel
  topo = ctx.topo
  tx, sgd = jdist.dist_opt(optax.sgd(LEARNING_RATE)), optax.sgd(LEARNING_RATE)
  placed = workload.style_setup(model, params, x, y)
  devices = topo.local_device_count
  first = lambda s: jax.device_get(jdist.unreplicate(s.state[0]))  # noqa: E731
  steps = {
      "jdist_jit": (lambda: placed.stepper("jit", tx), lambda s: jax.device_get(s.state[0])),
      "jdist_dp": (lambda: placed.stepper("data_parallel", tx), first),
  }
  comm = MPI.COMM_WORLD.Dup()
  one_device = devices == 1 and topo.process_count > 1
  if one_device:
    device = jax.local_devices()[0]
    hand_params = jax.device_put(params, device)
    hand_batch = jax.device_put(placed.process_rows, device)
    steps["mpi4jax"] = (lambda: timing.Stepper(
        jax.jit(workload.mpi4jax_step(model, sgd, comm)),
        (hand_params, sgd.init(hand_params)), hand_batch), lambda s: jax.device_get(s.state[0]))
  steps["floor"] = (lambda: placed.stepper("data_parallel", sgd,
                                           workload.compute_step(model, sgd)), first)
  steps["sync_floor"] = (lambda: placed.stepper("data_parallel", sgd,
                                                _sync_floor_step(model, sgd)), first)

  n = ALLREDUCE_BYTES // 4
  rows = workload.shard(np.ones((devices, n), np.float32))
  psum = jdist.data_parallel(jdist.psum)
  reduces = {"jdist.psum": lambda: psum(rows)}
  if one_device:
    total = jax.jit(workload.mpi4jax_sum(comm))
    flat = jax.device_put(np.ones(n, np.float32), jax.local_devices()[0])
    reduces["mpi4jax.allreduce"] = lambda: total(flat)
  send, recv = np.ones(n, np.float32), np.empty(n, np.float32)

  def mpi4py_allreduce():
    comm.Allreduce(send, recv, op=MPI.SUM)
    return recv

  reduces["mpi4py.Allreduce"] = mpi4py_allreduce
  return steps, reduces


def _xla_job(ctx, model, params, x, y) -> tuple[dict, dict]:
  """Plain JAX multi-controller: one mesh over every process's devices, XLA's collectives."""
  name = XLA_KINDS[ctx.options["kind"]]
  sgd = optax.sgd(LEARNING_RATE)
  mesh = Mesh(np.array(jax.devices()), ("data",))
  replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))

  def put(host, sharding):
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  g_params = jax.tree.map(lambda leaf: put(leaf, replicated), params)
  g_batch = (put(x, rows), put(y, rows))
  step = workload.plain_jit_step(model, sgd)
  host = lambda s: jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), s.state[0])  # noqa
  steps = {name: (lambda: timing.Stepper(
      step, (g_params, jax.jit(sgd.init, out_shardings=replicated)(g_params)), g_batch), host)}
  n = ALLREDUCE_BYTES // 4
  big = put(np.ones((len(jax.devices()), n), np.float32), rows)
  psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "data"), mesh=mesh,
                               in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")))
  # XLA's MPI collectives build their communicator only on the thread that started
  # MPI ("Multiple threads/devices per process are not yet supported"): a first
  # all-reduce here, on the main thread, builds the one every later call reuses.
  jax.block_until_ready(psum(put(np.ones((len(jax.devices()), 1), np.float32), rows)))
  return steps, {f"{name}.psum": lambda: psum(big)}


def run(ctx) -> Iterator[dict[str, Any]]:
  """One job's rows: per-step medians, loopback bytes per step, losses, all-reduces."""
  kind = ctx.options["kind"]
  model = workload.build("cnn")
  params = workload.init_params(model, 0)  # the same on every rank
  x, y = (a[0] for a in workload.local_batch(1, ctx.options.get("global_batch", 64), 1))
  with jax.set_mesh(jdist.mesh()) if kind == "jdist" else contextlib.nullcontext():
    steps, reduces = (_jdist_job if kind == "jdist" else _xla_job)(ctx, model, params, x, y)
    base = {"kind": kind, "processes": ctx.topo.process_count,
            "devices": ctx.topo.local_device_count,
            "collectives": jax.config.jax_cpu_collectives_implementation}
    steppers = {name: make() for name, (make, _) in steps.items()}
    series = timing.interleaved(steppers, repeats=ctx.repeats(ctx.options.get("steps", 40)),
                                warmup=ctx.warmup(5), sync=ctx.sync)
    for name, result in series.items():
      yield dict(base, part="step", variant=name, **result.as_dict())
    for name, stepper in steppers.items():
      ctx.sync()
      before = _lo_bytes()
      for _ in range(BYTE_STEPS):
        timing.timed(stepper)
      ctx.sync()
      yield dict(base, part="bytes", variant=name, bytes_per_step=(_lo_bytes() - before) / BYTE_STEPS)
    loss = jax.jit(lambda p: models.cross_entropy_loss(model.apply({"params": p}, x), y))
    for name, (make, host_params) in steps.items():
      fresh = make()
      for _ in range(LOSS_STEPS):
        fresh()
      yield dict(base, part="loss", variant=name, loss=float(loss(host_params(fresh))))
    series = timing.interleaved(reduces, repeats=timing.repeats_for(ALLREDUCE_BYTES, quick=ctx.quick),
                                warmup=2, sync=ctx.sync)
    for name, result in series.items():
      yield dict(base, part="allreduce", variant=name, bytes=ALLREDUCE_BYTES, **result.as_dict())


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--topologies", default="2x1,2x2", help="PROCESSESxDEVICES, comma-separated")
  parser.add_argument("--rounds", type=int, default=5, help="alternated rounds of the two jobs")
  parser.add_argument("--steps", type=int, default=40, help="timed steps per variant and job")
  parser.add_argument("--global-batch", type=int, default=64)
  parser.add_argument("--link", default="1gbit", help="--on shaped: the link (harness/netns.py)")
  parser.add_argument("--rig-rate", type=float, default=1000.0,
                      help="--on rig: each node's link in Mbit/s")
  parser.add_argument("--mpiwrapper", default=None,
                      help="an MPIwrapper library built against this MPI: adds plain JAX over "
                           "XLA's MPI collectives (MPItrampoline's MPITRAMPOLINE_LIB), 1 device "
                           "per process only")


def _topologies(text: str) -> list[tuple[int, int]]:
  try:
    pairs = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
  except ValueError:
    pairs = []
  if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
    raise UsageError(f"--topologies {text!r}: want PROCESSESxDEVICES,... (e.g. 2x1,2x2)")
  return pairs


def check(args: argparse.Namespace) -> None:
  _topologies(args.topologies)
  if args.rounds < 1 or args.steps < 3:
    raise UsageError("--rounds must be >= 1 and --steps >= 3")
  if args.mpiwrapper and not os.path.isfile(args.mpiwrapper):
    raise UsageError(f"--mpiwrapper {args.mpiwrapper}: no such file (libmpiwrapper.so of an "
                     "MPIwrapper built against this venv's MPI)")
  if args.on == "shaped":
    netns.link_named(args.link)
  if args.on == "rig" and any(processes % 2 for processes, _ in _topologies(args.topologies)):
    raise UsageError(f"--on rig --topologies {args.topologies}: the processes are split over "
                     "the rig's 2 nodes, so each count must be even (e.g. 2x1,2x2)")


@contextlib.contextmanager
def _place(args) -> Iterator[tuple[Callable[[jobs.Job], dict], str]]:
  """(how a job runs, what counts the bytes) at the place the jobs run."""
  def on_host(prefix=(), mpirun_args=()):
    return lambda job: jobs.run(dataclasses.replace(job, prefix=tuple(prefix),
                                                    mpirun_args=mpirun_args),
                                quick=args.quick, timeout=JOB_TIMEOUT)

  if args.on == "rig":  # a job's processes split over the rig's nodes
    from benchmarks.harness import cluster  # pylint: disable=import-outside-toplevel
    with cluster.Cluster(nodes=2, rate_mbit=args.rig_rate) as rig:
      yield (lambda job: cluster.run_job(rig, job, quick=args.quick, timeout=JOB_TIMEOUT),
             f"rig, {args.rig_rate:g} Mbit/s per node: each node's loopback (cross-node bytes "
             "cross the bridge)")
  elif args.on == "shaped":
    with netns.shaped_namespace(netns.link_named(args.link)) as name:
      yield on_host(netns.exec_prefix(name), netns.MPI_TCP_ARGS), f"netns, {args.link}"
  elif os.geteuid() == 0 and not netns.missing_requirements():
    with netns.private_namespace() as name:
      yield on_host(netns.exec_prefix(name)), "netns, shared memory"
  else:
    yield on_host(), "host loopback (other jobs' bytes included)"


def _rows(result: dict) -> list[dict]:
  section_result = result.get("sections", {}).get(NAME, {})
  if "error" in result or not section_result.get("complete"):
    raise RuntimeError(f"job {result.get('job')} failed: "
                       f"{section_result.get('error') or result.get('error', 'incomplete')}")
  return section_result["rows"]


def summarize(rounds: list[list[dict]]) -> dict[str, Any]:
  """One topology's rounds (each: the rows of its two jobs) -> medians, paired ratios, checks."""
  def table(part, key):
    out: dict[str, list[float]] = {}
    for rows in rounds:
      for row in rows:
        if row["part"] == part:
          out.setdefault(row["variant"], []).append(row[key])
    return out

  steps, reduces = table("step", "time_s"), table("allreduce", "time_s")
  losses = table("loss", "loss")
  checked = {name: v for name, v in losses.items() if not name.endswith("floor")}
  reference = checked["jdist_jit"][0]
  spread = max(abs(v - reference) / abs(reference) for values in checked.values() for v in values)
  ratios = {f"{mine}/{peer}": statistics.median(a / b for a, b in zip(steps[mine], steps[peer]))
            for mine in JDIST_VARIANTS for peer in (*JDIST_VARIANTS, *PEERS)
            if peer in steps and peer != mine}
  reduce_ratios = {f"jdist.psum/{peer}": statistics.median(
      a / b for a, b in zip(reduces["jdist.psum"], reduces[peer]))
                   for peer in reduces if peer != "jdist.psum"}
  return {"step_ms": {k: 1e3 * statistics.median(v) for k, v in steps.items()},
          "step_ratios": ratios,
          "bytes_per_step": {k: statistics.median(v)
                             for k, v in table("bytes", "bytes_per_step").items()},
          "allreduce_ms": {k: 1e3 * statistics.median(v) for k, v in reduces.items()},
          "allreduce_ratios": reduce_ratios,
          "losses": {k: v[0] for k, v in losses.items()}, "loss_spread": spread,
          "rounds": len(rounds)}


def main(args: argparse.Namespace) -> int:
  rounds, steps = (1, 5) if args.quick else (args.rounds, args.steps)
  topologies = _topologies(args.topologies)[:1] if args.quick else _topologies(args.topologies)
  env = {"jdist": (("JDIST_JAX_DISTRIBUTED", "1"),),
         "gloo": (("JDIST_JAX_DISTRIBUTED", "1"), ("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo")),
         "mpi": (("JDIST_JAX_DISTRIBUTED", "1"), ("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "mpi"),
                 ("MPITRAMPOLINE_LIB", os.path.abspath(args.mpiwrapper or "")))}
  link = {"shaped": args.link, "rig": f"rig, {args.rig_rate:g} Mbit/s per node"}
  results: dict[str, Any] = {"command": args.command, "place": args.on,
                             "link": link.get(args.on, "shm"),
                             "versions": _versions(), "topologies": {}}
  with _place(args) as (run_job, counted):
    results["bytes_counted_on"] = counted
    for processes, devices in topologies:
      per_round = []
      for index in range(rounds):
        rows = []
        kinds = ("jdist", "gloo") + (("mpi",) if args.mpiwrapper and devices == 1 else ())
        for kind in kinds:
          job = jobs.Job(f"{NAME}-{kind}-{processes}x{devices}", processes, devices,
                         (sys.modules[__name__],), env=env[kind],
                         options=(("kind", kind), ("steps", steps),
                                  ("global_batch", args.global_batch)))
          rows += _rows(run_job(job))
        per_round.append(rows)
        print(f"[{processes}x{devices}] round {index + 1}/{rounds}: " + ", ".join(
            f"{r['variant']} {1e3 * r['time_s']:.1f} ms" for r in rows if r["part"] == "step"),
              flush=True)
      summary = summarize(per_round)
      summary["load_average"] = os.getloadavg()
      summary["raw"] = per_round
      results["topologies"][f"{processes}x{devices}"] = summary
      if summary["loss_spread"] > LOSS_TOLERANCE:
        raise AssertionError(f"{processes}x{devices}: losses after {LOSS_STEPS} steps differ by "
                             f"{summary['loss_spread']:.2e} relative: {summary['losses']}")
  render = {"shaped": render_shaped, "rig": render_rig}.get(args.on, report)
  print(render(results))
  written = outputs.write_report(args.out, results, render, json_name="jax_peers.json",
                                 md_name="jax_peers.md")
  print(f"wrote {', '.join(os.path.join(args.out, w) for w in written)}")
  return 0


def _versions() -> dict[str, str]:
  import importlib.metadata as metadata  # pylint: disable=import-outside-toplevel
  found = {name: metadata.version(name) for name in ("jax", "jaxlib", "mpi4jax", "mpi4py")}
  with contextlib.suppress(Exception):
    from mpi4py import MPI  # pylint: disable=import-outside-toplevel
    found["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
  return found


def report(results: dict[str, Any]) -> str:
  """The Markdown report: per topology, step medians and paired ratios, bytes, all-reduces."""
  lines = [f"# jdist and its JAX peers ({results['link']})", "",
           f"`{results['command']}`; versions {json.dumps(results['versions'])}; loopback "
           f"bytes counted in: {results['bytes_counted_on']}.", ""]
  paired = lambda ratios: ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())  # noqa: E731
  for name, t in results["topologies"].items():
    lines += [f"## {name} ({t['rounds']} rounds, load average "
              f"{', '.join(f'{v:.1f}' for v in t['load_average'])})", ""]
    lines += benchmarks_report.table(
        ["variant", "median step ms", "loopback bytes / step", "loss after 20 steps"],
        [[variant, f"{ms:.1f}", f"{t['bytes_per_step'].get(variant, 0):,.0f}",
          f"{t['losses'].get(variant, float('nan')):.7f}"] for variant, ms in t["step_ms"].items()])
    lines += [f"Paired step ratios (median over rounds): {paired(t['step_ratios'])}.",
              f"Loss spread (every variant but the floors): {t['loss_spread']:.1e} relative.", ""]
    lines += benchmarks_report.table(["16 MiB all-reduce", "median ms"],
                                     [[k, f"{v:.1f}"] for k, v in t["allreduce_ms"].items()])
    lines += [f"Paired: {paired(t['allreduce_ratios'])}.", ""]
  return "\n".join(lines)


def render_shaped(results: dict[str, Any]) -> str:  # each place's report: its own renderer
  return report(results)


def render_rig(results: dict[str, Any]) -> str:
  return report(results)


_MODULE = sys.modules[__name__]
SECTION = section(NAME, "jdist (both styles) against plain JAX over Gloo and hand-written "
                  "mpi4jax: steps, 16 MiB all-reduces, loopback bytes, losses",
                  host=Run.of(_MODULE, report=report, out="docs/benchmarks/jax_peers", quick=True),
                  shaped=Run.of(_MODULE, report=render_shaped,
                                out="docs/benchmarks/jax_peers_shaped", quick=True),
                  rig=Run.of(_MODULE, report=render_rig, out="docs/benchmarks/jax_peers_rig",
                             quick=True))
