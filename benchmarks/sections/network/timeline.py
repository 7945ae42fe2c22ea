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

The cost of the timeline itself: docs/timeline.md ("Cost and size").
"""


from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Iterator

import jax

from benchmarks.harness import report

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
           "(`benchmarks/sections/network/timeline.py`): `posted` when the bucket's gradients existed (the "
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
