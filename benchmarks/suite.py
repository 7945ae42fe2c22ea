"""The benchmark suite: `python -m benchmarks suite [--quick] [--out DIR] [--only ...]`.

Starts each job (see `benchmarks.jobs`) one after the other, never two at
once, so they do not compete for the cores; then writes `results.json`, the
figures and `results.md` into the output directory (default
docs/benchmarks; the smoke run `--quick` defaults to a temporary directory
so it never overwrites real results). Its parts (`--only`) are
`benchmarks.registry.SUITE_PARTS`; "network" runs the network section on
shaped links and writes its own report (network.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks import analysis
from benchmarks import jobs as jobs_lib
from benchmarks import network
from benchmarks import outputs
from benchmarks import plots
from benchmarks import registry
from benchmarks import report

# Seconds each job may run before it is killed (a hang must not block the suite).
TIMEOUTS = {"1x1": 180, "1x2": 300, "1x4": 300, "2x1": 900, "2x2": 300, "2x1-jax": 300}
QUICK_TIMEOUT = 150


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--only", default=",".join(registry.SUITE_PARTS),
                      help=f"comma-separated parts to run, from {', '.join(registry.SUITE_PARTS)}")


def check(args: argparse.Namespace) -> None:
  unknown = set(args.only.split(",")) - set(registry.SUITE_PARTS)
  if unknown:
    raise registry.UsageError(f"--only: unknown part(s) {sorted(unknown)}; choose from "
                              f"{registry.SUITE_PARTS}.")


def run_suite(args: argparse.Namespace) -> dict:
  """Runs the jobs and returns the complete results (also the summary)."""
  start = time.perf_counter()
  environment = report.environment()
  selected = set(args.only.split(","))
  job_results = []
  for job in jobs_lib.jobs(selected, quick=args.quick):
    timeout = QUICK_TIMEOUT if args.quick else TIMEOUTS.get(job.name, 300)
    job_results.append(jobs_lib.run(job, quick=args.quick, timeout=timeout))
  environment["load_average_end"] = list(os.getloadavg())
  network_results = None
  if "network" in selected:  # its own jobs, links and report: see benchmarks.network
    network_results = network.run_network(quick=args.quick)
  command = "python -m benchmarks suite" + (" --quick" if args.quick else "") + (
      f" --only {args.only}" if selected != set(registry.SUITE_PARTS) else "")
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
  for target in summary["targets"]:
    status = {True: "met", False: "MISSED", None: "not measured"}[target["met"]]
    print(f"{target['target']} [{target['where']}]: {report.num(target['measured'], 4)} "
          f"(bound {target['bound']}) {status}")
  for failure in summary["failures"]:
    print(f"FAILURE in job {failure['job']} section {failure['section']}: "
          f"{str(failure['error']).splitlines()[0][:200]}", file=sys.stderr)
  print(f"Wrote {args.out}/results.json, results.md and {len(results['figures'])} figures "
        f"in {results['wall_s']:.0f} s.")
  return 0
