"""The benchmark suite: `python -m benchmarks suite [--quick] [--out DIR] [--only ...]`.

Writes results.json, the figures and results.md into --out; part "network" runs the network
section on shaped links (its own network.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from benchmarks.harness import analysis
from benchmarks.harness import jobs as jobs_lib
from benchmarks.harness import outputs
from benchmarks.harness import plots
from benchmarks.harness import report
from benchmarks.harness.section import Run, UsageError, section
from benchmarks.sections.network import shaped as network
from benchmarks.sections.suite import allreduce
from benchmarks.sections.suite import compression
from benchmarks.sections.suite import overhead
from benchmarks.sections.suite import scaling

# The suite's parts (`--only`): its measurements, "backends" (the backend-"jax" job's
# all-reduce) and "network" (the network section on shaped links).
PARTS = ("allreduce", "overhead", "compression", "scaling", "backends", "network")
# Seconds each job may run before it is killed (a hang must not block the suite).
TIMEOUTS = {"1x1": 180, "1x2": 300, "1x4": 300, "2x1": 900, "2x2": 300, "2x1-jax": 300}
QUICK_TIMEOUT = 150


def jobs(sections: set[str] | None = None, *, quick: bool = False) -> list[jobs_lib.Job]:
  """The suite's jobs, optionally only those measuring one of `sections`."""
  suite = [
      jobs_lib.Job("1x1", 1, 1, (scaling,)),
      jobs_lib.Job("1x2", 1, 2, (overhead, scaling)),
      jobs_lib.Job("1x4", 1, 4, (overhead,)),
      jobs_lib.Job("2x1", 2, 1, (allreduce, compression, scaling)),
      jobs_lib.Job("2x2", 2, 2, (allreduce, scaling)),
      jobs_lib.Job("2x1-jax", 2, 1, (allreduce,), backend="jax"),
      # One rank per replica: 2x2's replicas as MPI ranks, the layout a user
      # would otherwise pick (its raw MPI beside 2x2's jdist in the report).
      jobs_lib.Job("4x1", 4, 1, (allreduce,)),
  ]
  if quick:  # the smoke run: every section once, fewer jobs
    suite = [dataclasses.replace(job, sections=(allreduce,)) if job.name == "2x2" else job
             for job in suite if job.name not in ("1x4", "4x1")]
  if sections is None:
    return suite
  picked = []
  for job in suite:
    wanted = tuple(m for m in job.sections if m.NAME in sections or
                   (m is allreduce and job.backend == "jax" and "backends" in sections))
    if wanted:
      picked.append(dataclasses.replace(job, sections=wanted))
  return picked


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--only", default=",".join(PARTS),
                      help=f"comma-separated parts to run, from {', '.join(PARTS)}")


def check(args: argparse.Namespace) -> None:
  unknown = set(args.only.split(",")) - set(PARTS)
  if unknown:
    raise UsageError(f"--only: unknown part(s) {sorted(unknown)}; choose from "
                              f"{PARTS}.")


def run_suite(args: argparse.Namespace) -> dict:
  """Runs the jobs and returns the complete results (also the summary)."""
  start = time.perf_counter()
  environment = report.environment()
  selected = set(args.only.split(","))
  job_results = []
  for job in jobs(selected, quick=args.quick):
    timeout = QUICK_TIMEOUT if args.quick else TIMEOUTS.get(job.name, 300)
    job_results.append(jobs_lib.run(job, quick=args.quick, timeout=timeout))
  environment["load_average_end"] = list(os.getloadavg())
  network_results = None
  if "network" in selected:  # its own jobs, links and report: see benchmarks.sections.network.shaped
    network_results = network.run_network(quick=args.quick)
  command = "python -m benchmarks suite" + (" --quick" if args.quick else "") + (
      f" --only {args.only}" if selected != set(PARTS) else "")
  return {"command": command, "quick": args.quick, "wall_s": time.perf_counter() - start,
          "environment": environment, "jobs": job_results,
          "summary": analysis.summarize(job_results), "network": network_results}


def write_outputs(results: dict, out_dir: str) -> None:
  os.makedirs(out_dir, exist_ok=True)
  results["figures"] = plots.draw_all(results["summary"], out_dir)
  network_results = results.pop("network", None)
  if network_results is not None:  # network.json, network.md, network.png
    network.write_outputs(network_results, out_dir)
    results["network"] = {"report": "network.md", "skipped": network_results["skipped"],
                          "targets": network_results["summary"]["targets"]}
  outputs.write_report(out_dir, results, report.markdown, json_name="results.json",
                       md_name="results.md")


def main(args: argparse.Namespace) -> int:
  results = run_suite(args)
  write_outputs(results, args.out)
  summary = results["summary"]
  report.print_targets(summary["targets"], digits=4)
  for failure in summary["failures"]:
    print(f"FAILURE in job {failure['job']} section {failure['section']}: "
          f"{str(failure['error']).splitlines()[0][:200]}", file=sys.stderr)
  print(f"Wrote {args.out}/results.json, results.md and {len(results['figures'])} figures "
        f"in {results['wall_s']:.0f} s.")
  return 0


SECTION = section("suite", "the suite: all-reduce, overhead, compression, "
                  "scaling, backends, network (results.md and figures)",
                  host=Run.of(sys.modules[__name__], report=report.markdown, out="docs/benchmarks",
                              quick=True))
