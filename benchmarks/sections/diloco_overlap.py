"""Streaming DiLoCo's outer sync: in the step that starts it, or in the background.

    python -m benchmarks diloco_overlap [--links 1gbit,100mbit] [--rounds 8]
        [--sync-every 32] [--fragments 4] [--delay 4] [--payload int4|sparse|...]

Per link, a 2x1 job trains SINGA's CNN in blocks of `--sync-every` steps, alternating
`compute`, `no_sync`, `in_step` (`delay=0`) and `background` (`delay=τ`). The method and the
runs: docs/diloco.md (its pacing A/B: `git show 96c4069:benchmarks/sections/diloco_overlap.py`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np
import optax

import jdist
from benchmarks.harness import workload
from benchmarks.harness.section import Run, section
from benchmarks.sections import accuracy
from benchmarks.sections.suite import compression
from jdist.transforms import diloco

PER_REPLICA_BATCH = 64
VARIANTS = ("compute", "no_sync", "in_step", "background")


def _transformation(variant: str, options: dict) -> optax.GradientTransformation:
  inner = optax.sgd(compression.LEARNING_RATE)
  if variant == "compute":
    return inner
  delay = 0 if variant in ("in_step", "no_sync") else int(options["delay"])
  sync_every = accuracy.NEVER if variant == "no_sync" else int(options["sync_every"])
  return jdist.diloco(inner, sync_every=sync_every, fragments=int(options["fragments"]),
                      delay=delay, payload=options.get("payload") or None)


def _in_flight(state) -> int:
  flights = getattr(state, "in_flight", ())
  return int(np.count_nonzero(np.asarray(flights)[..., 2])) if np.size(flights) else 0


NAME = "diloco_overlap"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  """Yields one row per variant: seconds per block, per step, exposed share."""
  options = ctx.options
  sync_every, fragments = int(options["sync_every"]), int(options["fragments"])
  rounds = 2 if ctx.quick else int(options["rounds"])
  bench = workload.setup(options.get("model", "cnn"),  # tests: a small MLP
                         int(options.get("batch", PER_REPLICA_BATCH)))
  steppers = {}
  for variant in VARIANTS:
    tx = _transformation(variant, options)
    step = (workload.compute_step(bench.model, tx) if variant == "compute"
            else workload.jdist_step(bench.model, tx))
    steppers[variant] = bench.stepper(step, tx)
  # Warm-up (compiles): up to just past an apply step, so a block of H steps
  # reads every exchange it starts (syncs every H / P steps, read τ later).
  warmup = sync_every // fragments + int(options["delay"]) + 1
  for stepper in steppers.values():
    for _ in range(warmup):
      jax.block_until_ready(stepper())
  ctx.sync()
  blocks = {variant: [] for variant in VARIANTS}
  left = {variant: 0 for variant in VARIANTS}
  for _ in range(rounds):
    for variant, stepper in steppers.items():
      start = time.perf_counter()
      for _ in range(sync_every):
        out = stepper()
      jax.block_until_ready(out)
      blocks[variant].append(time.perf_counter() - start)
      left[variant] = max(left[variant], _in_flight(stepper.state[1]))
  # Untimed: one more block read step by step, to see the exchanges in flight.
  seen = {variant: 0 for variant in VARIANTS}
  for variant, stepper in steppers.items():
    ctx.sync()
    for _ in range(sync_every):
      stepper()
      seen[variant] = max(seen[variant], _in_flight(stepper.state[1]))
  compute, no_sync = blocks["compute"], blocks["no_sync"]
  for variant in VARIANTS:
    exposed = [(b - c) / c for b, c in zip(blocks[variant], compute)]
    sync_share = [(b - n) / n for b, n in zip(blocks[variant], no_sync)]
    yield {"variant": variant, "block_s": statistics.median(blocks[variant]),
           "step_s": statistics.median(blocks[variant]) / sync_every,
           "exposed_share": statistics.median(exposed),
           "sync_share": None if variant == "compute" else statistics.median(sync_share),
           "rounds": rounds,
           "sync_every": sync_every, "fragments": fragments,
           "delay": int(options["delay"]) if variant == "background" else 0,
           "payload": None if variant == "compute" else options.get("payload") or None,
           "route": jdist.collectives.route(), "in_flight_at_block_end": left[variant],
           "most_in_flight": seen[variant],
           "outer_syncs": None if variant == "compute" else int(
               jax.numpy.ravel(diloco.outer_syncs(steppers[variant].state[1]))[0])}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--links", default="1gbit,100mbit")
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--sync-every", type=int, default=32)
  parser.add_argument("--fragments", type=int, default=4)
  parser.add_argument("--delay", type=int, default=4)
  parser.add_argument("--payload", default="",
                      help="the pseudo-gradient's payload (jdist.diloco's payload=): "
                           "int8, int4, sparse[:fraction]; float32 when empty")


def main(args: argparse.Namespace) -> int:
  from benchmarks.harness import jobs as jobs_lib  # pylint: disable=import-outside-toplevel
  from benchmarks.harness import netns  # pylint: disable=import-outside-toplevel
  netns.terminate_on_sigterm()
  options = (("rounds", args.rounds), ("sync_every", args.sync_every),
             ("fragments", args.fragments), ("delay", args.delay), ("payload", args.payload))
  failed = False
  for link in [netns.link_named(name) for name in args.links.split(",")]:
    job = jobs_lib.Job(f"diloco_overlap@{link.name}", 2, 1, (sys.modules[__name__],),
                       options=options)
    with netns.link_namespace(link) as name:
      result = jobs_lib.run(netns.in_namespace(job, name), quick=False, timeout=600)
    if "error" in result:
      print(result["error"], file=sys.stderr)
      failed = True
    print(f"== {link.name} (load average {', '.join(f'{x:.1f}' for x in os.getloadavg())})")
    for row in result.get("sections", {}).get("diloco_overlap", {}).get("rows", []):
      print(f"{row['variant']:>10}: {row['step_s'] * 1e3:7.1f} ms/step, exposed "
            f"{100 * row['exposed_share']:6.1f}% of compute"
            + ("" if row["sync_share"] is None else
               f", outer sync {100 * row['sync_share']:5.1f}% of no_sync (utilization "
               f"{100 / (1 + row['sync_share']):5.1f}%)") +
            f", in flight at block end "
            f"{row['in_flight_at_block_end']}, most in flight {row['most_in_flight']}, "
            f"route {row['route']}")
  return 1 if failed else 0


SECTION = section("diloco_overlap",
                  "Streaming DiLoCo's outer sync in the step or in the background",
                  shaped=Run.of(sys.modules[__name__]))
