"""An example trace over a shaped link (as root):
`python -m benchmarks timeline --link 100mbit` runs `jdist train
--timeline` (2 processes x 2 devices, the CNN on Fashion-MNIST) inside a
network namespace whose loopback `tc` shapes (`benchmarks.netns`), then
`jdist timeline summarize --plot`; both land in docs/benchmarks/timeline/.
"""

from __future__ import annotations

import argparse
import os
import sys


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--link", default="100mbit", help="a name of benchmarks.netns.LINKS")
  parser.add_argument("--steps", default="21:29", help="--timeline-steps")
  parser.add_argument("--out", default="docs/benchmarks/timeline")
  parser.add_argument("--sparsify", help="e.g. topk:0.01 (default: plain all-reduce)")


def main(args: argparse.Namespace) -> int:
  """`jdist train --timeline` over a shaped link; the trace, its summary and plot in --out."""
  import subprocess  # pylint: disable=import-outside-toplevel
  from benchmarks import jobs as jobs_lib  # pylint: disable=import-outside-toplevel
  from benchmarks import netns  # pylint: disable=import-outside-toplevel
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
