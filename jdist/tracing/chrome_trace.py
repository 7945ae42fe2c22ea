"""The Chrome / Perfetto trace `jdist.timeline()` writes: building and splitting it.

Pure functions over each rank's records (see `jdist.tracing.recorder`):

  * a step: ("step", number, name, start_ns, done_ns) on the rank's own
    `time.monotonic_ns()` clock;
  * an exchange: ("x", ordinal, call, kind, label, nbytes, first_post_ns,
    last_post_ns, wire_ns, done_ns, route);
  * a step's counters: ("c", number, residual_norm or None, dense_bytes,
    sent_bytes) (`jdist.tracing.counters.Counters`).

`chrome_trace` turns every rank's records into one "traceEvents" JSON
object: a process per rank, a "steps" track and as many "exchanges" lanes as
exchanges overlap, counters per step (step time split, bytes, and where
recorded the compression ratio and the error-feedback residual norm). Clocks are aligned through each
rank's wall clock (`wall_minus_mono_ns`), good to the hosts' clock sync.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

STEP_TID = 0
FIRST_LANE_TID = 1


def _us(ns: float, base_ns: float) -> float:
  return round((ns - base_ns) / 1e3, 3)


def step_splits(steps: list[tuple], exchanges: list[tuple],
                waits: dict[tuple, float] | None = None,
                counters: list[tuple] | None = None) -> list[dict[str, Any]]:
  """Per step: its time split into compute, exposed exchange and waiting (ns).

  A step's exchanges are those first posted while it ran. After the last of
  its gradient exchanges (`gradient_exchanges`) was posted by every local
  device, the backward pass is over: the time from then until the last
  exchange is done is exposed exchange time, of which
  the slowest rank's lateness (`waits`, per (ordinal, call)) is waiting.
  The rest of the step is compute (overlapped exchanges included).
  A step with `counters` carries them as "residual_norm", "dense_bytes"
  and "sent_bytes" (None without).
  """
  by_step = {int(c[1]): c for c in counters or ()}
  out = []
  ordered = sorted(exchanges, key=lambda x: x[6])
  for step in steps:
    _, number, name, start, done = step
    mine = [x for x in ordered if start <= x[6] <= done]
    total = max(done - start, 0)
    exposed = waiting = 0.0
    nbytes = sum(x[5] for x in mine)
    if mine:
      last_post = max(x[7] for x in gradient_exchanges(mine))
      last = max(mine, key=lambda x: x[9])
      exposed = max(0.0, min(done, last[9]) - max(start, last_post))
      waiting = min(exposed, (waits or {}).get((last[1], last[2]), 0.0))
    counted = by_step.get(number, (None,) * 5)
    out.append({"step": number, "name": name, "start": start, "done": done,
                "total": total, "compute": total - exposed, "exposed": exposed - waiting,
                "waiting": waiting, "bytes": nbytes, "exchanges": len(mine),
                "residual_norm": counted[2], "dense_bytes": counted[3],
                "sent_bytes": counted[4]})
  return out


def gradient_exchanges(exchanges: list[tuple]) -> list[tuple]:
  """Those a jdist transformation traced (the gradient's buckets), else all of them.

  A step's own `jdist.psum`/`pmean` (labelled "psum/pmean: ...", such as the
  metric sums) may be posted whenever XLA schedules it, even after the
  gradients' exchanges are done: it does not say when the backward pass ended.
  """
  found = [x for x in exchanges if not str(x[4]).startswith("psum/pmean")]
  return found or exchanges


def compression_ratio(rows: list[dict[str, Any]]) -> float | None:
  """Dense over sent bytes, summed over `rows` (steps that sent nothing count too)."""
  counted = [r for r in rows if r.get("sent_bytes") is not None]
  sent = sum(r["sent_bytes"] for r in counted)
  return sum(r["dense_bytes"] for r in counted) / sent if sent > 0 else None


def counter_events(split: dict[str, Any], rank: int, ts: float) -> list[dict[str, Any]]:
  """The "C" events of one step's counters (none for a step without)."""
  events = []
  if split.get("sent_bytes"):  # a step that sent nothing has no ratio of its own
    events.append({"ph": "C", "name": "compression ratio", "pid": rank, "ts": ts,
                   "args": {"dense / sent": round(split["dense_bytes"] / split["sent_bytes"], 4)}})
  if split.get("residual_norm") is not None:
    events.append({"ph": "C", "name": "residual norm", "pid": rank, "ts": ts,
                   "args": {"l2": split["residual_norm"]}})
  return events


def slowest_waits(ranks: dict[int, dict[str, Any]]) -> dict[int, dict[tuple, float]]:
  """Per rank and exchange (ordinal, call): ns it waited for the last rank to post."""
  ready: dict[tuple, dict[int, float]] = {}
  for rank, part in ranks.items():
    shift = part["wall_minus_mono_ns"]
    for x in part["exchanges"]:
      ready.setdefault((x[1], x[2]), {})[rank] = x[7] + shift
  out: dict[int, dict[tuple, float]] = {rank: {} for rank in ranks}
  for key, by_rank in ready.items():
    latest = max(by_rank.values())
    for rank, at in by_rank.items():
      out[rank][key] = max(0.0, latest - at)
  return out


def _lanes(exchanges: list[tuple]) -> list[int]:
  """A lane per exchange such that exchanges in one lane do not overlap."""
  ends: list[float] = []
  lanes = []
  for x in exchanges:
    start, end = x[6], max(x[9], x[6])
    for lane, last_end in enumerate(ends):
      if last_end <= start:
        ends[lane] = end
        lanes.append(lane)
        break
    else:
      ends.append(end)
      lanes.append(len(ends) - 1)
  return lanes


def rank_events(rank: int, part: dict[str, Any], base_ns: float,
                waits: dict[tuple, float]) -> list[dict[str, Any]]:
  """One rank's trace events (wall-aligned: `base_ns` is the trace's time 0)."""
  shift = part["wall_minus_mono_ns"] - base_ns
  at = lambda ns: _us(ns + shift, 0)  # noqa: E731
  host = f" ({part['host']})" if part.get("host") else ""
  events = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}{host}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": STEP_TID,
             "args": {"name": "steps (host)"}}]
  steps = sorted(part["steps"], key=lambda s: s[3])
  exchanges = sorted(part["exchanges"], key=lambda x: x[6])
  for split in step_splits(steps, exchanges, waits, part.get("counters")):
    events.append({"ph": "X", "cat": "step", "name": f"step {split['step']}", "pid": rank,
                   "tid": STEP_TID, "ts": at(split["start"]), "dur": _us(split["total"], 0),
                   "args": {"function": split["name"], "exchanges": split["exchanges"],
                            "bytes": split["bytes"]}})
    end = at(split["done"])
    events.append({"ph": "C", "name": "step time (ms)", "pid": rank, "ts": end,
                   "args": {key: round(split[key] / 1e6, 4)
                            for key in ("compute", "exposed", "waiting")}})
    events.append({"ph": "C", "name": "bytes per step", "pid": rank, "ts": end,
                   "args": {"bytes": split["bytes"]}})
    events.extend(counter_events(split, rank, end))
  lanes = _lanes(exchanges)
  for lane in sorted(set(lanes)):
    events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": FIRST_LANE_TID + lane,
                   "args": {"name": f"exchanges (engine), lane {lane}"}})
  for x, lane in zip(exchanges, lanes):
    _, ordinal, call, kind, label, nbytes, first, last, wire, done, route = x
    tid = FIRST_LANE_TID + lane
    wait = waits.get((ordinal, call), 0.0)
    args = {"ordinal": ordinal, "call": call, "kind": kind, "payload": label, "bytes": nbytes,
            "route": route, "waited_for_slowest_ms": round(wait / 1e6, 4)}
    events.append({"ph": "X", "cat": "exchange", "name": f"#{ordinal} {label}", "pid": rank,
                   "tid": tid, "ts": at(first), "dur": _us(max(done - first, 0), 0),
                   "args": args})
    phases = [("posted", first, last), ("local reduce", last, wire or last),
              ("on the wire", wire or last, done)]
    for name, begin, end in phases:
      if end > begin:
        events.append({"ph": "X", "cat": "exchange", "name": name, "pid": rank, "tid": tid,
                       "ts": at(begin), "dur": _us(end - begin, 0), "args": {"bytes": nbytes}})
    if wait > 0 and wire:
      events.append({"ph": "X", "cat": "exchange", "name": "waiting for the slowest rank",
                     "pid": rank, "tid": tid, "ts": at(wire),
                     "dur": _us(min(wait, max(done - wire, 0)), 0), "args": {}})
  return events


def chrome_trace(ranks: dict[int, dict[str, Any]], complete: bool = True) -> dict[str, Any]:
  """Every rank's part as one trace object ({"traceEvents": [...], ...}).

  Args:
    ranks: rank -> its part: {"steps", "exchanges", "wall_minus_mono_ns",
      "host", "dropped"} (see `jdist.tracing.recorder.Timeline.part`).
    complete: every rank's part is here (else: a part written on abort).
  """
  starts = [r["wall_minus_mono_ns"] + min([s[3] for s in r["steps"]] +
                                         [x[6] for x in r["exchanges"]] or [0])
            for r in ranks.values()]
  base = min(starts) if starts else 0
  waits = slowest_waits(ranks) if complete else {rank: {} for rank in ranks}
  events: list[dict[str, Any]] = []
  for rank in sorted(ranks):
    events.extend(rank_events(rank, ranks[rank], base, waits[rank]))
  return {"traceEvents": events, "displayTimeUnit": "ms",
          "otherData": {"producer": "jdist.timeline", "complete": complete,
                        "ranks": sorted(ranks), "base_wall_ns": base,
                        "dropped_records": {str(r): p.get("dropped", 0) for r, p in ranks.items()},
                        "parts": {str(r): p for r, p in ranks.items()}}}


def write_atomically(path: str, trace: dict[str, Any]) -> None:
  """Writes `trace` as JSON to `path` through a temporary file and a rename."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, partial = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                                 dir=directory)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as stream:
      json.dump(trace, stream, separators=(",", ":"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, 0o666 & ~umask)  # as open() would have made it, not mkstemp's 0600
    os.replace(partial, path)
  except BaseException:
    if os.path.exists(partial):
      os.unlink(partial)
    raise
