"""Network section: jdist against PyTorch DDP on emulated cluster links.

    python -m benchmarks network [--quick] [--out DIR] [--links shm,1gbit] [--topologies 2x1]

Per link and topology one job (`steps`) times jdist's modes, a hand-written mpi4jax step,
raw MPI and DDP interleaved. Writes network.json, .md and .png (docs/benchmarks/network.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Callable

from benchmarks.harness import jobs as jobs_lib
from benchmarks.harness import netns
from benchmarks.harness import outputs
from benchmarks.harness import plots
from benchmarks.harness import report
from benchmarks.harness.section import UsageError, torch_missing
from benchmarks.sections.network import report as network_report
from benchmarks.sections.network import steps as network_steps

TOPOLOGIES = {"2x1": (2, 1), "2x2": (2, 2)}
RIG_LINKS = ("10gbit", "1gbit", "100mbit")  # --on rig (benchmarks.sections.network.rig)
QUICK_MODES = ("plain", "fp16")  # the smoke run: one compressed mode beside plain
TORCH_VARIANTS = ("compute", "ddp", "ddp_fp16", "ddp_powersgd")  # benchmarks.harness.torch_peer's
QUICK_TORCH_VARIANTS = ("compute", "ddp")
REPEATS = 15
JOB_TIMEOUT = 480  # seconds per job; a hang must not block the run


def cell_job(topology: str, link: netns.Link, *, quick: bool, repeats: int,
             with_torch: bool, modes=None) -> jobs_lib.Job:
  """The job of one link and topology: jdist's variants and (with torch) DDP's."""
  processes, devices = TOPOLOGIES[topology]
  options = {"repeats": repeats, "warmup": network_steps.WARMUP}
  if quick or modes:
    options["modes"] = list(modes or QUICK_MODES)
  env = ()
  if with_torch:
    options["torch"] = list(QUICK_TORCH_VARIANTS if quick else TORCH_VARIANTS)
    env += netns.gloo_env()
  return jobs_lib.Job(f"{topology}@{link.name}", processes, devices, (network_steps,), env=env,
                      options=tuple(options.items()))


def run_network(links=None, topologies=None, *, quick: bool = False, repeats: int | None = None,
                modes=None, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs the network section (links and topologies default to all; quick: 1gbit, 2x1; modes
  to every one of `steps.MODES`); returns its results, summary included.
  """
  start, environment = time.perf_counter(), report.environment()
  names = links or (("1gbit",) if quick else [link.name for link in netns.LINKS])
  topologies = topologies or (("2x1",) if quick else tuple(TOPOLOGIES))
  chosen, skipped = netns.available_links(netns.link_named(name) for name in names)
  skipped += [reason] if (reason := torch_missing()) else []
  for line in skipped:
    log(f"[network] SKIPPED {line}")
  netns.remove_stale()
  results = []
  for link in chosen:
    with netns.link_namespace(link) as name:
      for topology in topologies:
        job = netns.in_namespace(cell_job(topology, link, quick=quick, repeats=repeats or REPEATS,
                                          with_torch=reason is None, modes=modes), name)
        result = jobs_lib.run(job, quick=quick, timeout=JOB_TIMEOUT, log=log)
        results.append(dict(result, link=link.name, topology_name=topology))
  out = report.results("python -m benchmarks network" + (" --quick" if quick else ""),
                       environment, start, quick=quick, skipped=skipped, jobs=results,
                       links=[dataclasses.asdict(l) for l in chosen])
  out["summary"] = network_report.summarize(out)
  return out


def write_outputs(results: dict, out_dir: str) -> list[str]:
  """network.json, network.md and the figure; returns the files written."""
  os.makedirs(out_dir, exist_ok=True)
  figure = plots.network(results["summary"], out_dir)
  results["figures"] = [figure] if figure else []
  written = outputs.write_report(out_dir, results, network_report.markdown,
                                 json_name="network.json", md_name="network.md")
  return written + [f"{name}.png" for name in results["figures"]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Options of the network section in both places (`--on shaped`, `--on rig`)."""
  parser.add_argument("--links", help="comma-separated: shaped from "
                      + ",".join(link.name for link in netns.LINKS) + "; rig from "
                      + ",".join(RIG_LINKS))
  parser.add_argument("--repeats", type=int, help=f"timed rounds (default {REPEATS}; rig: "
                      "training rounds)")
  parser.add_argument("--render", metavar="JSON", help="measure nothing: re-derive the summary "
                      "of a results JSON and rewrite its report (and figure) into --out")
  parser.add_argument("--topologies", help="shaped only: comma-separated, from "
                      + ",".join(TOPOLOGIES))
  parser.add_argument("--modes", help="shaped only: comma-separated jdist modes (default all: "
                      "plain, fp16, bf16, topk1%%, topk1%%-block, threshold, partial4, powersgd4, "
                      "powersgd1)")


def check(args: argparse.Namespace) -> None:
  if args.on == "rig":
    if args.topologies or args.modes:
      raise UsageError("--topologies and --modes: only with --on shaped")
    if args.links and set(args.links.split(",")) - set(RIG_LINKS):
      raise UsageError(f"--links: choose from {list(RIG_LINKS)}")
    args.links = args.links.split(",") if args.links else None
    return
  try:
    args.links = [netns.link_named(n).name for n in args.links.split(",")] if args.links else None
  except ValueError as err:
    raise UsageError(str(err)) from err
  if args.topologies and set(args.topologies.split(",")) - set(TOPOLOGIES):
    raise UsageError(f"--topologies: choose from {list(TOPOLOGIES)}")
  args.topologies = args.topologies.split(",") if args.topologies else None


def run_main(args: argparse.Namespace, measure: Callable[[], dict],
             summarize: Callable[[dict], dict], write: Callable[[dict, str], list[str]]) -> int:
  """`--render`, or `measure()`'s results written and their targets and failures printed."""
  done = outputs.measure_or_render(args, lambda _: dict(measure(), command=args.command),
                                   summarize, write)
  if done is None:
    return 0
  results, written = done
  report.print_targets(results["summary"]["targets"])
  for failure in results["summary"]["failures"]:
    print(f"FAILURE in job {failure['job']}: {str(failure['error']).splitlines()[0][:200]}",
          file=sys.stderr)
  print(f"Wrote {', '.join(written)} into {args.out} in {results['wall_s']:.0f} s.")
  return 0


def main(args: argparse.Namespace) -> int:
  """`python -m benchmarks network --on shaped` (`--on rig`: `benchmarks.sections.network.rig`)."""
  return run_main(args, lambda: run_network(
      args.links, args.topologies, quick=args.quick, repeats=args.repeats,
      modes=args.modes.split(",") if args.modes else None), network_report.summarize,
                  write_outputs)
