"""Reading the ranks' flight recorders: the first exchange they disagree on.

Pure helpers of the watchdog's abort report. Each rank's status reply
carries `flight_recorder.summary()`: its last exchanges (ordinal, call,
kind, bytes, state, age) and how far each ordinal got. An exchange is named
alike on every rank (ordinal and call; host exchanges by their count), so a
rank whose progress on an ordinal stops below a call another rank posted
never posted it.
"""

from __future__ import annotations

from typing import Any

from jdist.runtime import flight_recorder


def _key(row: dict[str, Any]) -> tuple:
  return ("host", row["ordinal"]) if row["kind"] == "host" else \
      ("step", row["ordinal"], row["call"])


def _standing(summary: dict[str, Any], key: tuple, rows: dict[tuple, dict]) -> str:
  """'posted'/'wire'/'done' as recorded; 'passed' (evicted), 'never' or 'unknown'."""
  if key in rows:
    return rows[key]["state"]
  if key[0] == "host":
    return "passed" if summary.get("host", 0) >= key[1] else "never"
  progress = summary.get("progress", {})
  if key[1] not in progress:
    return "unknown" if summary.get("entries") else "never"
  return "passed" if progress[key[1]] >= key[2] else "never"


def first_divergence(recorders: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
  """The oldest exchange some rank posted and another never did, or None.

  Without one, the oldest exchange every rank posted but some did not finish
  (the exchange itself is stuck) is returned, with `never` empty.

  Args:
    recorders: each rank's `flight_recorder.summary()` (ranks that did not
      answer are absent).

  Returns:
    {"key", "ordinal", "call", "kind", "label", "nbytes", "states": {rank:
    standing}, "never": [ranks], "age_s", "labels": {rank: its call} where
    the ranks' host exchange of that count were different calls, else {}},
    or None when every recorded exchange finished everywhere.
  """
  tables = {rank: {_key(row): row for row in summary.get("entries", ())}
            for rank, summary in recorders.items()}
  seen: dict[tuple, dict] = {}
  for table in tables.values():
    for key, row in table.items():
      if key not in seen or row["age_s"] > seen[key]["age_s"]:
        seen[key] = row
  diverged, stuck = [], []
  for key, row in seen.items():
    states = {rank: _standing(recorders[rank], key, tables[rank]) for rank in sorted(recorders)}
    never = [rank for rank, state in states.items() if state == "never"]
    # Host exchange N of one rank met another call on another rank.
    labels = ({rank: tables[rank][key].get("label") for rank in sorted(tables)
               if key in tables[rank]} if key[0] == "host" else {})
    if len(set(labels.values())) > 1:
      diverged.append((row["age_s"], key, row, states, never, labels))
    elif never:
      diverged.append((row["age_s"], key, row, states, never, {}))
    elif any(state in ("posted", "wire") for state in states.values()):
      stuck.append((row["age_s"], key, row, states, never, {}))
  for found in (diverged, stuck):
    if found:
      age, key, row, states, never, labels = max(found, key=lambda item: item[0])
      return {"key": key, "ordinal": row["ordinal"], "call": row["call"], "kind": row["kind"],
              "label": row.get("label") or row["kind"], "nbytes": row["nbytes"],
              "states": states, "never": never, "age_s": age, "labels": labels}
  return None


def name_exchange(found: dict[str, Any]) -> str:
  """'exchange ordinal 2 (call 5, allreduce: dense sum, 41,024 B)' or 'host exchange 7 (...)'."""
  if found["kind"] == "host":
    return f"host exchange {found['ordinal']} ({found['label']})"
  return (f"exchange ordinal {found['ordinal']} (call {found['call']}, {found['label']}, "
          f"{found['nbytes']:,} B)")


def _short(row: dict[str, Any]) -> str:
  what = f"host {row['ordinal']}" if row["kind"] == "host" else \
      f"#{row['ordinal']}.{row['call']} {row['kind']}"
  return f"{what} {row['state']}"


def describe(recorders: dict[int, dict[str, Any]], size: int | None = None,
             last: int = 4) -> str:
  """The flight recorder section of an abort report (empty if nothing was recorded).

  Args:
    recorders: each answering rank's `flight_recorder.summary()`.
    size: ranks in the job (to name those that did not answer).
    last: entries shown per rank.
  """
  if not any(summary.get("entries") for summary in recorders.values()):
    return ""
  lines = []
  found = first_divergence(recorders)
  if found is None:
    lines.append("Flight recorder: every recorded exchange finished on every rank.")
  elif len(set(found.get("labels", {}).values())) > 1:
    calls = ", ".join(f"rank {rank} posted {label}" for rank, label in found["labels"].items())
    lines.append(f"Flight recorder: the ranks first disagree at host exchange {found['ordinal']}, "
                 f"first posted {found['age_s']:.1f} s ago, a different call on each side: "
                 f"{calls}.")
  else:
    posted = [f"rank {rank} ({state})" for rank, state in found["states"].items()
              if state not in ("never", "unknown")]
    head = (f"Flight recorder: the ranks first disagree at {name_exchange(found)}, first "
            f"posted {found['age_s']:.1f} s ago: posted by {', '.join(posted) or 'no rank'}")
    if found["never"]:
      head += f"; never posted by rank(s) {', '.join(map(str, found['never']))}."
    else:
      head += "; every rank posted it, and it did not finish."
    lines.append(head)
  if size is not None:
    silent = [rank for rank in range(size) if rank not in recorders]
    if silent:
      lines.append(f"  (no recorder from rank(s) {', '.join(map(str, silent))}: they did not "
                   f"answer)")
  for rank in sorted(recorders):
    rows = recorders[rank].get("entries", ())[-last:]
    if rows:
      lines.append(f"  rank {rank} last exchanges (ordinal.call): "
                   + ", ".join(_short(row) for row in rows))
  return "\n".join(lines)


def with_section(report: str, replies: dict[int, dict[str, Any]], rank: int, size: int) -> str:
  """`report`, then the recorders' section (this rank's own recorder read now).

  Args:
    report: the watchdog's report.
    replies: each peer's status reply (its recorder under "flight") or, for
      a departed rank, its departure message (the same key).
    rank: the reporting rank.
    size: ranks in the job.
  """
  recorders = {peer: reply["flight"] for peer, reply in replies.items() if reply.get("flight")}
  recorders[rank] = flight_recorder.summary()
  section = describe(recorders, size)
  return f"{report}\n{section}" if section else report
