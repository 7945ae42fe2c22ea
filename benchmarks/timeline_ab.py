"""What the timeline and the flight recorder cost per step (docs/timeline.md):
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
with its quartiles and a bootstrap 95% interval of that median (`ci95`,
resampled rounds), next to the machine's load average: a target is shown
where the interval's upper end is under it. On a loaded machine
the A/A's spread is wider than the targets, so the run also times the host
code each adds per step directly (`host_cpu_us_per_step`, CPU time): the timeline's hooks
(`observe` in the loop, the step listener on the watchdog's thread) and the
flight recorder's step hooks, summed over the timed blocks.

    bash scripts/mpirun.sh -np 2 .venv/bin/python -m benchmarks timeline_ab \\
        --cpu-devices 2 --rounds 60 --block 10 --out docs/benchmarks/timeline/ab.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

import jax


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


BOOTSTRAP_RESAMPLES = 10_000


def median_interval(values: list[float], seed: int = 0) -> tuple[float, float]:
  """A bootstrap 95% interval of the median of `values` (rounds resampled with
  replacement, `BOOTSTRAP_RESAMPLES` times, a fixed seed: reproducible)."""
  rng = random.Random(seed)
  medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                   for _ in range(BOOTSTRAP_RESAMPLES))
  return medians[int(0.025 * len(medians))], medians[int(0.975 * len(medians)) - 1]


def ratio_summary(values: list[float]) -> dict[str, Any]:
  """`values`' quartiles with the bootstrap 95% interval of their median."""
  low, high = median_interval(values)
  return {**_quartiles(values), "ci95": [round(low, 4), round(high, 4)]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--cpu-devices", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=40)
  parser.add_argument("--block", type=int, default=8, help="steps per variant per round")
  parser.add_argument("--batch", type=int, default=32, help="examples per replica")
  parser.add_argument("--sparsify", default=None, help="e.g. topk:0.01 (default: dense)")
  parser.add_argument("--out", help="rank 0 writes the results here (JSON)")


def main(args: argparse.Namespace) -> int:
  """The A/B of the module docstring; rank 0 prints it (and writes --out)."""
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
            "ratios": {name: ratio_summary(values) for name, values in ratios.items()},
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
