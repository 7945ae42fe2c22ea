"""When each exchange of a step runs: the native engine's timeline beside the step's.

With `JDIST_NATIVE_TRACE` set (the network benchmark sets it), jdist's native
engine keeps, for every exchange, the monotonic times at which its first and
last local device posted it (its gradients existed), its MPI part started and
it completed (`jdist.collectives.native.take_trace`). Timing a few steps from
Python on the same clock (`time.monotonic_ns`) places them in the step:

  * exchange time before the last bucket's `posted` ran while the backward
    pass was still producing earlier layers' gradients (`overlap_ms`);
  * the step ends about when the last exchange is done: what is exposed is
    the last bucket's exchange plus what the overlap slowed the compute down.

`record` runs in the benchmark's worker (rank 0's rows are kept); `markdown`
renders the rows in network.md.

**What the timeline and the flight recorder cost** (`ab_main`, docs/timeline.md):
under mpirun, `jdist train`'s own compiled step (the SINGA CNN on 28x28
inputs) runs in blocks of steps, each block in one of four variants, in a
shuffled order every round (the same on every rank):

  * `off`: the defaults (flight recorder on, no timeline);
  * `off_again`: the same again: the A/A, this machine's noise floor;
  * `timeline`: inside `jdist.timeline(...)`, with `observe()` after each
    step as `jdist train --timeline` calls it (the file is written after
    the block, outside the timed part);
  * `no_recorder`: the flight recorder's Python side off
    (`flight_recorder.set_enabled(False)`, as `JDIST_FLIGHT_RECORDER=0`).

Each round gives ratios of block means (timeline / off, off / no_recorder,
off_again / off); the median of the ratios over the rounds is the figure,
with its quartiles, next to the machine's load average. On a loaded machine
the A/A's spread is wider than the targets, so the run also times the host
code each adds per step directly (`host_cpu_us_per_step`, CPU time): the timeline's hooks
(`observe` in the loop, the step listener on the watchdog's thread) and the
flight recorder's step hooks, summed over the timed blocks.

    bash scripts/mpirun.sh -np 2 .venv/bin/python -m benchmarks.timeline ab \\
        --cpu-devices 2 --rounds 60 --block 10 --out docs/benchmarks/timeline/ab.json

**An example trace over a shaped link** (`shaped_main`, as root):
`python -m benchmarks.timeline shaped --link 100mbit` runs `jdist train
--timeline` (2 processes x 2 devices, the CNN on Fashion-MNIST) inside a
network namespace whose loopback `tc` shapes (`benchmarks.netns`), then
`jdist timeline summarize --plot`; both land in docs/benchmarks/timeline/.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import jax

from benchmarks import report

STEPS = 5  # timed steps per mode; the one of median length is reported
MODES = ("plain", "fp16")
KINDS = {0: "sum", 1: "sum16", 2: "gather"}


def enabled() -> bool:
  """Whether the engine records its timeline in this process."""
  from jdist.collectives import native  # pylint: disable=import-outside-toplevel
  return native.running() and bool(os.environ.get(native.TRACE_ENV))


def _exchanges(rows, start_ns: int, end_ns: int) -> list[dict[str, Any]]:
  ms = lambda t: round((int(t) - start_ns) / 1e6, 2)
  picked = [r for r in rows if start_ns <= r[4] and r[7] <= end_ns]
  return [{"ordinal": int(r[0]), "kind": KINDS.get(int(r[2]), str(r[2])),
           "bytes": int(r[3]), "posted_ms": ms(r[5]), "mpi_ms": ms(r[6]),
           "done_ms": ms(r[7])} for r in sorted(picked, key=lambda r: r[5])]


def record(steppers: dict[str, Callable[[], Any]], compute_s: float | None,
           sync: Callable[[], None] | None) -> Iterator[dict[str, Any]]:
  """Times `STEPS` steps of each mode of `MODES` in `steppers`; one row per mode.

  Every rank runs the same steps (collective); rows carry the step whose
  duration is the median, with its exchanges in posting order.
  """
  if not enabled():
    return
  from jdist.collectives import native  # pylint: disable=import-outside-toplevel
  for mode in (m for m in MODES if m in steppers):
    if sync is not None:
      sync()
    native.take_trace()  # forget the timed rounds'
    spans = []
    for _ in range(STEPS):
      start = time.monotonic_ns()
      jax.block_until_ready(steppers[mode]())
      spans.append((start, time.monotonic_ns()))
    rows = native.take_trace()
    median = statistics.median_low([end - start for start, end in spans])
    start, end = next(span for span in spans if span[1] - span[0] == median)
    yield {"variant": f"timeline_{mode}", "kind": "timeline", "mode": mode,
           "step_ms": round(median / 1e6, 2),
           "compute_ms": None if compute_s is None else round(compute_s * 1e3, 2),
           "exchanges": _exchanges(rows, start, end)}


def overlap_ms(row: dict[str, Any]) -> float:
  """How long some exchange was on the wire before the last bucket was posted.

  Until the last bucket's gradients exist the backward pass is computing, so
  this is exchange time hidden behind compute (the union of the exchanges'
  [MPI start, done] intervals, cut at the last bucket's posting).
  """
  exchanges = row["exchanges"]
  if not exchanges:
    return 0.0
  last_posted = max(e["posted_ms"] for e in exchanges)
  spans = sorted((e["mpi_ms"], min(e["done_ms"], last_posted)) for e in exchanges
                 if e["mpi_ms"] < last_posted)
  total, reached = 0.0, float("-inf")
  for begin, end in spans:
    begin = max(begin, reached)
    if end > begin:
      total += end - begin
      reached = end
  return total


def markdown(rows: list[dict[str, Any]]) -> list[str]:
  """network.md's timeline section: one table per topology, link and mode."""
  if not rows:
    return []
  lines = ["## When the exchanges run (native engine timeline)", "",
           "One step of median length per mode, times in ms from the step's dispatch "
           "(`benchmarks/timeline.py`): `posted` when the bucket's gradients existed (the "
           "last local device posted it), `done` when its sum was written back. The "
           "buckets are cut last layer first; an exchange done before the last bucket is "
           "posted ran while the backward pass was still computing. `compute` is the "
           "compute-only step's median in the same job.", ""]
  for row in rows:
    body = [[e["ordinal"], e["kind"], f"{e['bytes'] / 1e3:.1f} KB", report.ms(
        e["posted_ms"] / 1e3), report.ms(e["done_ms"] / 1e3)] for e in row["exchanges"]]
    lines += [f"**{row['topology']} {row['link']} {row['mode']}**: step "
              f"{report.ms(row['step_ms'] / 1e3)} ms, compute-only "
              f"{report.ms((row['compute_ms'] or 0) / 1e3)} ms; exchanges were on the "
              f"wire for {report.ms(overlap_ms(row) / 1e3)} ms before the last bucket was "
              f"posted (hidden behind the backward pass).", ""]
    lines += report.table(["ordinal", "kind", "bytes", "posted ms", "done ms"], body)
  return lines


# --- the overhead A/B of the timeline and of the flight recorder -------------

AB_VARIANTS = ("off", "off_again", "timeline", "no_recorder")
AB_RATIOS = {"timeline / off": ("timeline", "off"), "off / no_recorder": ("off", "no_recorder"),
             "off_again / off (A/A)": ("off_again", "off")}
IN_FLIGHT = 2  # as jdist train: the host reads a step's metric sums two steps later


def _ab_program(args):
  """jdist train's compiled CNN step, its state and one fixed batch per replica."""
  from jdist.app import config as config_lib  # pylint: disable=import-outside-toplevel
  from jdist.app import cpu_devices  # pylint: disable=import-outside-toplevel
  from jdist.app import train  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from benchmarks import workload  # pylint: disable=import-outside-toplevel
  cpu_devices.force_cpu_devices(args.cpu_devices)
  import jdist  # pylint: disable=import-outside-toplevel
  topo = jdist.init()
  spec = config_lib.TrainConfig(model="cnn", sparsify=args.sparsify).optimizer_spec
  program = train._program("cnn", 10, (28, 28, 1), spec, topo)  # pylint: disable=protected-access
  params, model_state = jdist.broadcast_params(program.init(0, topo.process_index))
  state = {"params": jdist.replicate(params), "model_state": jdist.replicate(model_state)}
  state["opt_state"] = program.opt_init(state["params"])
  rng = np.random.default_rng(1 + topo.process_index)
  devices, batch = topo.local_device_count, args.batch
  batch = {"x": workload.shard(rng.random((devices, batch, 28, 28, 1), np.float32)),
           "y": workload.shard(rng.integers(0, 10, (devices, batch)).astype(np.int32)),
           "weight": workload.shard(np.ones((devices, batch), np.float32))}
  return topo, program, state, batch


def _ab_block(program, state, batch, steps: int, recorder=None) -> float:
  """Seconds per step over `steps` steps, as jdist train's loop runs them."""
  in_flight = collections.deque()
  start = time.perf_counter()
  for _ in range(steps):
    (state["params"], state["model_state"], state["opt_state"], sums,
     _) = program.train_step(state["params"], state["model_state"], state["opt_state"], batch)
    if recorder is not None:
      recorder.observe(state["opt_state"], state["params"])
    in_flight.append(sums)
    if len(in_flight) > IN_FLIGHT:
      jax.device_get(in_flight.popleft())
  jax.block_until_ready((state["params"], list(in_flight)))
  return (time.perf_counter() - start) / steps


class _HostClock:
  """Wraps functions so that the CPU time spent inside them adds up in `ns`, per name.

  The calling thread's CPU time: on a loaded machine, wall time would count
  the time the thread waited for a core.
  """

  def __init__(self):
    self.ns: dict[str, int] = collections.Counter()
    self.names: list[str] = []
    self.on: set[str] = set()  # the names being timed now

  def wrap(self, owner: Any, attribute: str, name: str) -> None:
    inner = getattr(owner, attribute)
    self.names.append(name)

    def timed(*args, **kwargs):
      if name not in self.on:
        return inner(*args, **kwargs)
      start = time.thread_time_ns()
      try:
        return inner(*args, **kwargs)
      finally:
        self.ns[name] += time.thread_time_ns() - start

    setattr(owner, attribute, timed)


def _quartiles(values: list[float]) -> dict[str, float]:
  q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
  return {key: round(v, 4) for key, v in (("median", statistics.median(values)), ("q1", q[0]),
                                          ("q3", q[2]), ("min", min(values)), ("max", max(values)))}


def ab_main(argv=None) -> int:
  """The A/B of the module docstring; rank 0 prints it (and writes --out)."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.timeline")
  parser.add_argument("--cpu-devices", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=40)
  parser.add_argument("--block", type=int, default=8, help="steps per variant per round")
  parser.add_argument("--batch", type=int, default=32, help="examples per replica")
  parser.add_argument("--sparsify", default=None, help="e.g. topk:0.01 (default: dense)")
  parser.add_argument("--out", help="rank 0 writes the results here (JSON)")
  args = parser.parse_args(argv)
  topo, program, state, batch = _ab_program(args)
  from jdist import timeline_recorder  # pylint: disable=import-outside-toplevel
  from jdist.runtime import flight_recorder  # pylint: disable=import-outside-toplevel
  from jdist.runtime import host  # pylint: disable=import-outside-toplevel
  trace = os.path.join(tempfile.mkdtemp(prefix="jdist-timeline-ab-"), "t.json")
  clock = _HostClock()  # the recorder's step hooks, as the watchdog calls them
  clock.wrap(flight_recorder, "step_dispatched", "recorder")
  clock.wrap(flight_recorder, "step_done", "recorder")
  for name in ("observe", "step_dispatched", "step_done"):  # the timeline's, per instance
    clock.wrap(timeline_recorder.Timeline, name, f"timeline.{name}")
  steps_timed: collections.Counter = collections.Counter()
  per_step: dict[str, list[float]] = {v: [] for v in AB_VARIANTS}
  loads, sizes = [], []
  for round_ in range(-1, args.rounds):  # round -1 compiles and warms every variant up
    order = list(AB_VARIANTS)
    random.Random(round_).shuffle(order)  # the same order on every rank
    for variant in order:
      host.barrier("timeline A/B")  # the ranks start each block together
      recorder = None
      if variant == "timeline":
        recorder = timeline_recorder.timeline(trace, function="train_step")
      elif variant == "no_recorder":
        flight_recorder.set_enabled(False)
      # The recorder's hooks alone in "off" blocks (in "timeline" ones they call the timeline).
      clock.on = {"off": {"recorder"}, "timeline": {n for n in clock.names if "." in n}}.get(
          variant, set()) if round_ >= 0 else set()
      try:
        seconds = _ab_block(program, state, batch, args.block, recorder)
        time.sleep(0.05)  # the watchdog's monitor reports the block's last steps
      finally:
        clock.on = set()
        steps_timed[variant] += args.block if round_ >= 0 else 0
        flight_recorder.set_enabled(True)
        if recorder is not None and recorder.close() and round_ == 0:
          sizes.append(os.path.getsize(trace))
      if round_ >= 0:
        per_step[variant].append(seconds)
    loads.append(os.getloadavg()[0])
  if topo.process_index != 0:
    return 0
  ratios = {name: [a / b for a, b in zip(per_step[num], per_step[den])]
            for name, (num, den) in AB_RATIOS.items()}
  result = {"topology": f"{topo.process_count}x{topo.local_device_count}",
            "model": "cnn (SINGA), 28x28x1", "batch_per_replica": args.batch,
            "sparsify": args.sparsify, "rounds": args.rounds, "block_steps": args.block,
            "jax": jax.__version__, "cpus": os.cpu_count(),
            "load_average": _quartiles(loads),
            "step_ms": {v: _quartiles([t * 1e3 for t in per_step[v]]) for v in AB_VARIANTS},
            "ratios": {name: _quartiles(values) for name, values in ratios.items()},
            "host_cpu_us_per_step": {
                name: round(clock.ns[name] / 1e3 / max(
                    steps_timed["timeline" if "." in name else "off"], 1), 1)
                for name in dict.fromkeys(clock.names)},
            "trace_bytes_per_block": sizes[0] if sizes else None}
  print(json.dumps(result, indent=1))
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as stream:
      json.dump({**result, "per_step_s": per_step}, stream, indent=1)
  return 0


def step_plot(trace: str, out: str, rank: int = 0) -> int:
  """Draws rank `rank`'s recorded step of median length with its exchanges' phases.

  Returns:
    The step's number (the watchdog's count).
  """
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
  from jdist import timeline_format  # pylint: disable=import-outside-toplevel
  from jdist.app import timeline_cli  # pylint: disable=import-outside-toplevel
  part = timeline_cli.load(trace)[0][rank]
  steps = sorted(part["steps"], key=lambda s: s[4] - s[3])
  _, number, _, start, done = steps[len(steps) // 2]
  mine = sorted((x for x in part["exchanges"] if start <= x[6] <= done), key=lambda x: x[6])
  ms = lambda ns: (ns - start) / 1e6  # noqa: E731
  figure, axis = pyplot.subplots(figsize=(12, 1.4 + 0.45 * (len(mine) + 1)))
  axis.barh(0, ms(done), left=0, color="#4c72b0", height=0.5)
  labels = [f"step {number}"]
  colors = {"posted": "#c6dbef", "local reduce": "#9ecae1", "on the wire": "#dd8452"}
  for row, x in enumerate(mine, start=1):
    _, ordinal, _, _, label, nbytes, first, last, wire, end, _ = x
    for name, begin, finish in (("posted", first, last), ("local reduce", last, wire or last),
                                ("on the wire", wire or last, end)):
      if finish > begin:
        axis.barh(row, ms(finish) - ms(begin), left=ms(begin), color=colors[name],
                  height=0.5, label=name if row == 1 or name == "on the wire" else None)
    size = f"{nbytes / 1e3:,.0f} KB" if nbytes >= 1000 else f"{nbytes} B"
    labels.append(f"#{ordinal} {label.split(':')[0]}, {size}")
  if mine:
    last_post = max(x[7] for x in timeline_format.gradient_exchanges(mine))
    axis.axvline(ms(last_post), color="k", linestyle="--", linewidth=1,
                 label="last gradient bucket posted:\nbackward pass over")
  handles, names = axis.get_legend_handles_labels()
  unique = dict(zip(names, handles))
  axis.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize="small")
  axis.set_yticks(range(len(labels)), labels)
  axis.invert_yaxis()
  axis.set_xlabel("ms from the step's start")
  axis.set_title(f"rank {rank}: one step and its exchanges", fontsize="medium")
  figure.tight_layout()
  figure.savefig(out, dpi=110)
  pyplot.close(figure)
  return number


def shaped_main(argv=None) -> int:
  """`jdist train --timeline` over a shaped link; the trace, its summary and plot in --out."""
  import subprocess  # pylint: disable=import-outside-toplevel
  from benchmarks import jobs as jobs_lib  # pylint: disable=import-outside-toplevel
  from benchmarks import netns  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser(prog="python -m benchmarks.timeline shaped")
  parser.add_argument("--link", default="100mbit", help="a name of benchmarks.netns.LINKS")
  parser.add_argument("--steps", default="21:29", help="--timeline-steps")
  parser.add_argument("--out", default="docs/benchmarks/timeline")
  parser.add_argument("--sparsify", help="e.g. topk:0.01 (default: plain all-reduce)")
  args = parser.parse_args(argv)
  link = netns.link_named(args.link)
  name = link.name + (f"_{args.sparsify.replace(':', '')}" if args.sparsify else "")
  missing = netns.missing_requirements()
  if missing:
    raise SystemExit("cannot shape a link here: " + "; ".join(missing))
  os.makedirs(args.out, exist_ok=True)
  trace = os.path.join(args.out, f"trace_{name}.json")
  last = int(args.steps.partition(":")[2] or 30)
  train = [sys.executable, "-m", "jdist.app.cli", "train", "--cpu-devices", "2",
           "--model", "cnn", "--dataset", "fashion_mnist", "--no-download",
           "--train-limit", "4096", "--max-steps", str(last + 2), "--eval-every", "0",
           "--no-progress", "--timeline", trace, "--timeline-steps", args.steps,
           *(["--sparsify", args.sparsify] if args.sparsify else [])]
  mpirun = [jobs_lib.mpirun_binary(), "--oversubscribe", "-np", "2", *netns.MPI_TCP_ARGS]
  if os.geteuid() == 0:
    mpirun.insert(1, "--allow-run-as-root")
  with netns.shaped_namespace(link) as namespace:
    subprocess.run(netns.exec_prefix(namespace) + mpirun + train, check=True, timeout=900)
  summary = subprocess.run(
      [sys.executable, "-m", "jdist.app.cli", "timeline", "summarize", trace, "--plot",
       os.path.join(args.out, f"split_{name}.png")],
      check=True, capture_output=True, text=True).stdout
  with open(os.path.join(args.out, f"summary_{name}.txt"), "w", encoding="utf-8") as out:
    out.write(summary)
  number = step_plot(trace, os.path.join(args.out, f"step_{name}.png"))
  print(summary + f"\nstep plot: step {number} of rank 0")
  return 0


if __name__ == "__main__":
  COMMANDS = {"ab": ab_main, "shaped": shaped_main}
  if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
    raise SystemExit(f"usage: python -m benchmarks.timeline {{{','.join(COMMANDS)}}} ...")
  raise SystemExit(COMMANDS[sys.argv[1]](sys.argv[2:]))
