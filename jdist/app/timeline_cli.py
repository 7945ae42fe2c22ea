"""`jdist timeline summarize FILE [--plot OUT.png]`: read a `--timeline` trace.

Prints, per rank, where a step's time goes: compute (exchanges hidden
behind it included), exposed exchange (the devices wait for an exchange
after the backward pass) and waiting (the part of that spent waiting for
the slowest rank to post), plus exchanges and bytes per step, and where the
trace has them the compression ratio (dense over sent bytes, over the window)
and the mean error-feedback residual norm. `--plot` draws the same split per
step and rank, and the residual norm per step (matplotlib, `pip install
jdist[bench]`). A trace written on an abort or a signal is one file per rank
(`FILE`, `FILE.rank<r>.json`): they are merged.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from typing import Any

from jdist.tracing import chrome_trace as timeline_format


def load(path: str) -> tuple[dict[int, dict[str, Any]], bool]:
  """Every rank's part in `path` and its per-rank siblings; (parts, complete).

  Raises:
    ValueError: not a jdist timeline.
  """
  parts: dict[int, dict[str, Any]] = {}
  complete = True
  for name in [path] + sorted(glob.glob(glob.escape(path) + ".rank*.json")):
    with open(name, encoding="utf-8") as stream:
      trace = json.load(stream)
    other = trace.get("otherData", {}) if isinstance(trace, dict) else {}
    if other.get("producer") != "jdist.timeline":
      raise ValueError(f"{name} is not a trace written by jdist.timeline")
    complete = complete and bool(other.get("complete"))
    for rank, part in other.get("parts", {}).items():
      parts[int(rank)] = part
  return parts, complete


def splits(parts: dict[int, dict[str, Any]], complete: bool) -> dict[int, list[dict[str, Any]]]:
  """Per rank, each recorded step's split (`timeline_format.step_splits`)."""
  waits = timeline_format.slowest_waits(parts) if complete else {r: {} for r in parts}
  return {rank: timeline_format.step_splits(sorted(part["steps"], key=lambda s: s[3]),
                                            part["exchanges"], waits[rank],
                                            part.get("counters"))
          for rank, part in sorted(parts.items())}


def summary_text(per_rank: dict[int, list[dict[str, Any]]], complete: bool) -> str:
  lines = []
  if not complete:
    lines.append("(an incomplete trace: written on an abort or a signal; waiting for the "
                 "slowest rank is counted as exposed exchange)")
  counted = any(r["sent_bytes"] is not None for rows in per_rank.values() for r in rows)
  lines.append(f"{'rank':>4} {'steps':>6} {'step ms':>9} {'compute':>9} {'exposed':>9} "
               f"{'waiting':>9} {'exch/step':>9} {'bytes/step':>11}"
               + (f" {'ratio':>7} {'residual':>9}" if counted else ""))
  for rank, rows in per_rank.items():
    if not rows:
      lines.append(f"{rank:>4} {0:>6}   (no step recorded)")
      continue
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    total = mean("total")
    share = lambda key: f"{mean(key) / 1e6:6.2f} {100 * mean(key) / total if total else 0:2.0f}%"  # noqa: E731,E501
    lines.append(f"{rank:>4} {len(rows):>6} {total / 1e6:9.2f} {share('compute'):>9} "
                 f"{share('exposed'):>9} {share('waiting'):>9} {mean('exchanges'):9.1f} "
                 f"{mean('bytes'):11,.0f}" + (counter_columns(rows) if counted else ""))
  lines.append("compute: the step minus exposed exchange and waiting (exchanges that overlap "
               "the backward pass count here); exposed: after the last exchange was posted, "
               "until it was done; waiting: the part of that spent waiting for the slowest "
               "rank to post it (docs/timeline.md).")
  if counted:
    lines.append("ratio: bytes a dense all-reduce of the gradient would have sent across "
                 "processes over the bytes sent, over the window; residual: the mean "
                 "L2 norm of the error-feedback residual (- where the state holds none).")
  return "\n".join(lines)


def counter_columns(rows: list[dict[str, Any]]) -> str:
  """A rank's compression ratio over its steps and its mean residual norm ('-': none)."""
  ratio = timeline_format.compression_ratio(rows)
  norms = [r["residual_norm"] for r in rows if r["residual_norm"] is not None]
  return (f" {ratio:7.2f}" if ratio is not None else f" {'-':>7}") + (
      f" {statistics.fmean(norms):9.4g}" if norms else f" {'-':>9}")


def plot(per_rank: dict[int, list[dict[str, Any]]], out: str) -> None:
  """A PNG: per rank, a stacked bar per step (compute, exposed exchange, waiting), in ms."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError("--plot needs matplotlib (pip install 'jdist[bench]')") from None
  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  ranks = list(per_rank) or [0]
  residual = any(r["residual_norm"] is not None for rows in per_rank.values() for r in rows)
  panels = len(ranks) + int(residual)
  figure, axes = pyplot.subplots(panels, 1, figsize=(10, 1.8 + 1.6 * panels),
                                 sharex=True, squeeze=False)
  colors = {"compute": "#4c72b0", "exposed": "#dd8452", "waiting": "#c44e52"}
  for axis, rank in zip(axes[:, 0], ranks):
    rows = per_rank.get(rank, [])
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for key, color in colors.items():
      values = [r[key] / 1e6 for r in rows]
      axis.bar(steps, values, bottom=bottom, color=color, width=1.0, label=key)
      bottom = [b + v for b, v in zip(bottom, values)]
    ratio = timeline_format.compression_ratio(rows)
    axis.set_ylabel(f"rank {rank}\nms")
    if ratio is not None:
      axis.set_title(f"rank {rank}: compression ratio {ratio:.2f} (dense / sent bytes)",
                     fontsize="small", loc="left")
  if residual:  # one more panel: the error-feedback residual norm of every rank
    axis = axes[len(ranks), 0]
    for rank in ranks:
      rows = [r for r in per_rank.get(rank, []) if r["residual_norm"] is not None]
      axis.plot([r["step"] for r in rows], [r["residual_norm"] for r in rows],
                marker=".", label=f"rank {rank}")
    axis.set_ylabel("residual\nL2 norm")
    axis.legend(loc="upper right", ncol=len(ranks), fontsize="small")
  axes[0, 0].legend(loc="upper right", ncol=3, fontsize="small")
  axes[-1, 0].set_xlabel("step")
  figure.suptitle("jdist timeline: step time per rank")
  figure.tight_layout()
  figure.savefig(out, dpi=110)
  pyplot.close(figure)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="jdist timeline", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="command", required=True)
  summarize = commands.add_parser("summarize", help="per-rank step time split (and a plot)")
  summarize.add_argument("file", help="a trace written by jdist train --timeline")
  summarize.add_argument("--plot", metavar="OUT.png", help="also draw the split per step")
  args = parser.parse_args(argv)
  try:
    parts, complete = load(args.file)
    per_rank = splits(parts, complete)
    print(summary_text(per_rank, complete))
    if args.plot:
      plot(per_rank, args.plot)
      print(f"plot: {args.plot}")
  except (OSError, ValueError) as err:
    print(f"jdist timeline: error: {err}", file=sys.stderr)
    return 1
  return 0
