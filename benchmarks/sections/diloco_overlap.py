"""Streaming DiLoCo's outer sync: in the step that starts it, or in the background.

    python -m benchmarks diloco_overlap [--links 1gbit,100mbit] [--rounds 8]
        [--sync-every 32] [--fragments 4] [--delay 4] [--background-segment-bytes B]
        [--background-window K]

Each link gets a 2x1 job in a shaped namespace (root), on SINGA's CNN
(431,080 parameters) with 64 images per replica, inner optimizer SGD. Three
variants train in blocks of `--sync-every` consecutive steps, the variants
alternating block by block for `--rounds` rounds:

  * `compute`: the same step with no exchange at all (the compute floor);
  * `no_sync`: the DiLoCo step of the other variants (its bookkeeping, the
    loss mean every step) with a sync period longer than the run, so it
    never syncs: the reference for the outer sync's own cost;
  * `in_step`: `jdist.diloco(..., fragments=P, delay=0)`: each fragment's
    averaged pseudo-gradient is exchanged inside the step that starts it, so
    a sync step waits for the wire;
  * `background`: `delay=τ`: on the native route the fragment's sum is
    started in the sync step and read τ steps later (`jdist.collectives.
    deferred`), while the inner steps in between compute. The engine paces
    that sum (`jdist/collectives/native/pacing.h`): small segments, one at a
    time, so each step's own exchanges pass between them;
  * `unpaced`: the same with pacing off (`deferred.set_segment_bytes(0)`
    for its blocks): the whole sum handed to MPI at once, as before pacing.

A block is timed from its first dispatch to its last result, so a block's
time per step is the inner step time with the outer syncs of that block
included. Blocks start after `τ + 1` warm-up steps past a multiple of H / P,
so every exchange a block starts is also read inside it (checked: the row
says how many were still in flight at the block's end). Each variant's
exposed sync time is its block time minus the `compute` block of the same
round, over `compute`'s (median over rounds); its outer sync's share
(`sync_share`) is the same against the `no_sync` block of the round.
"""

from __future__ import annotations

import argparse
import contextlib
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
VARIANTS = ("compute", "no_sync", "in_step", "background", "unpaced")
SMALL_BYTES = 64  # exchanges up to this size are a step's own (the loss mean)


def _transformation(variant: str, options: dict) -> optax.GradientTransformation:
  inner = optax.sgd(compression.LEARNING_RATE)
  if variant == "compute":
    return inner
  delay = 0 if variant in ("in_step", "no_sync") else int(options["delay"])
  sync_every = accuracy.NEVER if variant == "no_sync" else int(options["sync_every"])
  return jdist.diloco(inner, sync_every=sync_every,
                      fragments=int(options["fragments"]), delay=delay)


def _in_flight(state) -> int:
  flights = getattr(state, "in_flight", ())
  return int(np.count_nonzero(np.asarray(flights)[..., 2])) if np.size(flights) else 0


@contextlib.contextmanager
def _paced(variant: str):
  """Turns the engine's pacing of started sums off for the `unpaced` variant."""
  from jdist.collectives import deferred  # pylint: disable=import-outside-toplevel
  from jdist.collectives import native  # pylint: disable=import-outside-toplevel
  if variant != "unpaced" or not native.running():
    yield
    return
  previous = deferred.set_segment_bytes(0)
  try:
    yield
  finally:
    deferred.set_segment_bytes(previous)


def _take_trace():
  """The native engine's exchange rows since the last call (none without its trace)."""
  from jdist.collectives import native  # pylint: disable=import-outside-toplevel
  return native.take_trace() if native.running() else np.zeros((0, 8), np.int64)


def _placed(steps, rows) -> list[dict]:
  """Each exchange's posting, MPI start and completion, as (step, ms into that step)."""
  def where(t):
    for index, (start, end) in enumerate(steps):
      if t < end or index == len(steps) - 1:
        return index, round((int(t) - start) / 1e6, 1)
  # trace.h's columns: ordinal, seq, kind, bytes, first post, last post, MPI start, done.
  return [{"bytes": int(r[3]), "posted": where(r[5]), "mpi": where(r[6]), "done": where(r[7])}
          for r in rows if steps and r[5] >= steps[0][0]]


def _small_waits(rows, behind: bool) -> list[float]:
  """How long each of the steps' own small exchanges took in the timed
  blocks, from its last local post to done (ms; the peer's lateness
  included): those posted while a fragment's sum (over 64 KiB) was on the
  wire (`behind`), or the others."""
  big = [(r[6], r[7]) for r in rows if r[3] > 64 << 10]
  return [round((int(r[7]) - int(r[5])) / 1e6, 1) for r in rows if r[3] <= SMALL_BYTES
          and any(start <= r[5] < end for start, end in big) == behind]


NAME = "diloco_overlap"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  """Yields one row per variant: seconds per block, per step, exposed share."""
  options = ctx.options
  sync_every, fragments = int(options["sync_every"]), int(options["fragments"])
  rounds = 2 if ctx.quick else int(options["rounds"])
  bench = workload.setup(options.get("model", "cnn"),  # tests: a small MLP
                         int(options.get("batch", PER_REPLICA_BATCH)))
  if options.get("background_segment_bytes") is not None:
    from jdist.collectives import deferred  # pylint: disable=import-outside-toplevel
    deferred.set_segment_bytes(int(options["background_segment_bytes"]))
  steppers = {}
  for variant in VARIANTS:
    tx = _transformation(variant, options)
    step = (workload.compute_step(bench.model, tx) if variant == "compute"
            else workload.jdist_step(bench.model, tx))
    steppers[variant] = bench.stepper(step, tx)
  # Warm-up (compiles): up to just past an apply step, so a block of H steps
  # reads every exchange it starts (syncs every H / P steps, read τ later).
  warmup = sync_every // fragments + int(options["delay"]) + 1
  for variant, stepper in steppers.items():
    with _paced(variant):
      for _ in range(warmup):
        jax.block_until_ready(stepper())
  ctx.sync()
  blocks = {variant: [] for variant in VARIANTS}
  traced = {variant: [] for variant in VARIANTS}  # the engine's rows of the timed blocks
  _take_trace()
  left = {variant: 0 for variant in VARIANTS}
  for _ in range(rounds):
    for variant, stepper in steppers.items():
      with _paced(variant):
        start = time.perf_counter()
        for _ in range(sync_every):
          out = stepper()
        jax.block_until_ready(out)
        blocks[variant].append(time.perf_counter() - start)
      traced[variant].extend(_take_trace())
      left[variant] = max(left[variant], _in_flight(stepper.state[1]))
  # Untimed: one more block read step by step, to see the exchanges in flight
  # and (with the engine's trace on) when each was on the wire.
  seen = {variant: 0 for variant in VARIANTS}
  spans = {}
  for variant, stepper in steppers.items():
    ctx.sync()
    _take_trace()
    spans[variant] = []
    with _paced(variant):
      for _ in range(sync_every):
        start = time.monotonic_ns()
        stepper()
        seen[variant] = max(seen[variant], _in_flight(stepper.state[1]))
        spans[variant].append((start, time.monotonic_ns()))
    spans[variant] = (spans[variant], _take_trace())
  compute, no_sync = blocks["compute"], blocks["no_sync"]
  for variant in VARIANTS:
    exposed = [(b - c) / c for b, c in zip(blocks[variant], compute)]
    sync_share = [(b - n) / n for b, n in zip(blocks[variant], no_sync)]
    behind, alone = (_small_waits(traced[variant], flag) for flag in (True, False))
    yield {"variant": variant, "block_s": statistics.median(blocks[variant]),
           "step_s": statistics.median(blocks[variant]) / sync_every,
           "exposed_share": statistics.median(exposed),
           "sync_share": None if variant == "compute" else statistics.median(sync_share),
           "rounds": rounds,
           "sync_every": sync_every, "fragments": fragments,
           "delay": int(options["delay"]) if variant in ("background", "unpaced") else 0,
           "route": jdist.collectives.route(), "in_flight_at_block_end": left[variant],
           "most_in_flight": seen[variant], "exchanges": _placed(*spans[variant]),
           "outer_syncs": None if variant == "compute" else int(
               jax.numpy.ravel(diloco.outer_syncs(steppers[variant].state[1]))[0]),
           "small_waits_ms_behind_fragment": behind, "small_waits_ms_alone": alone}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--links", default="1gbit,100mbit")
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--sync-every", type=int, default=32)
  parser.add_argument("--fragments", type=int, default=4)
  parser.add_argument("--delay", type=int, default=4)
  parser.add_argument("--background-segment-bytes", type=int, default=None,
                      help="wire bytes per segment of a started sum (the engine's "
                      "default, 64 KiB, where not given)")
  parser.add_argument("--background-window", type=int, default=None,
                      help="segments of a started sum on the wire at once "
                      "($JDIST_NATIVE_BACKGROUND_WINDOW; the engine's default, 1, where not given)")


def main(args: argparse.Namespace) -> int:
  from benchmarks.harness import jobs as jobs_lib  # pylint: disable=import-outside-toplevel
  from benchmarks.harness import netns  # pylint: disable=import-outside-toplevel
  from benchmarks.sections.network import shaped as network  # pylint: disable=g-import-not-at-top
  netns.terminate_on_sigterm()
  options = (("rounds", args.rounds), ("sync_every", args.sync_every),
             ("fragments", args.fragments), ("delay", args.delay),
             ("background_segment_bytes", args.background_segment_bytes))
  window = (() if args.background_window is None
            else (("JDIST_NATIVE_BACKGROUND_WINDOW", str(args.background_window)),))
  failed = False
  for link in [netns.link_named(name) for name in args.links.split(",")]:
    job = jobs_lib.Job(f"diloco_overlap@{link.name}", 2, 1, (sys.modules[__name__],),
                       options=options, env=(("JDIST_NATIVE_TRACE", "1"),) + window)
    with network.link_namespace(link) as name:
      result = jobs_lib.run(network.in_namespace(job, name), quick=False, timeout=600)
    if "error" in result:
      print(result["error"], file=sys.stderr)
      failed = True
    print(f"== {link.name} (load average {', '.join(f'{x:.1f}' for x in os.getloadavg())})")
    for row in result.get("sections", {}).get("diloco_overlap", {}).get("rows", []):
      print(f"{row['variant']:>10}: {row['step_s'] * 1e3:7.1f} ms/step, exposed "
            f"{100 * row['exposed_share']:6.1f}% of compute"
            + ("" if row["sync_share"] is None else
               f", outer sync {100 * row['sync_share']:5.1f}% of no_sync") +
            f", in flight at block end "
            f"{row['in_flight_at_block_end']}, most in flight {row['most_in_flight']}, "
            f"route {row['route']}")
      for label, key in (("behind a fragment", "behind_fragment"), ("alone", "alone")):
        waits = row[f"small_waits_ms_{key}"]
        if waits:
          print(f"{'':>12}small exchanges {label}: {len(waits)}, posted->done median "
                f"{statistics.median(waits)} ms, max {max(waits)} ms")
      for exchange in row["exchanges"]:
        print(f"{'':>12}{exchange['bytes']:>9} bytes: posted in step {exchange['posted'][0]} "
              f"(+{exchange['posted'][1]} ms), on the wire from step {exchange['mpi'][0]} "
              f"(+{exchange['mpi'][1]} ms), done in step {exchange['done'][0]} "
              f"(+{exchange['done'][1]} ms)")
  return 1 if failed else 0


SECTION = section("diloco_overlap",
                  "Streaming DiLoCo's outer sync in the step or in the background",
                  shaped=Run.of(sys.modules[__name__]))
