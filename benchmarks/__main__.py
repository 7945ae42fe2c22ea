"""Runs the benchmark suite: `python -m benchmarks [--quick] [--out DIR] [--only ...]`.

Starts each job (see `benchmarks.jobs`) one after the other, never two at
once, so they do not compete for the cores; then writes `results.json`, the
figures and `results.md` into the output directory (default
docs/benchmarks; the smoke run `--quick` defaults to a temporary directory
so it never overwrites real results).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from benchmarks import analysis
from benchmarks import jobs as jobs_lib
from benchmarks import network
from benchmarks import plots
from benchmarks import report

SECTIONS = ("allreduce", "half", "overhead", "compression", "selection", "scaling", "backends",
            "network")
# Seconds each job may run before it is killed (a hang must not block the suite).
TIMEOUTS = {"1x1": 180, "1x2": 300, "1x4": 300, "2x1": 900, "2x2": 300, "2x1-jax": 300}
QUICK_TIMEOUT = 150


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: tiny sizes and models, about a minute")
  parser.add_argument("--out", help="output directory (default docs/benchmarks; "
                      "with --quick a temporary directory)")
  parser.add_argument("--only", default=",".join(SECTIONS),
                      help=f"comma-separated sections to run, from {', '.join(SECTIONS)}")
  args = parser.parse_args(argv)
  unknown = set(args.only.split(",")) - set(SECTIONS)
  if unknown:
    parser.error(f"--only: unknown section(s) {sorted(unknown)}; choose from {SECTIONS}.")
  if args.out is None:
    args.out = (os.path.join(tempfile.gettempdir(), "jdist-benchmarks-quick") if args.quick
                else os.path.join(jobs_lib.REPO, "docs", "benchmarks"))
  return args


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
  command = "python -m benchmarks" + (" --quick" if args.quick else "") + (
      f" --only {args.only}" if selected != set(SECTIONS) else "")
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
  with open(os.path.join(out_dir, "results.json"), "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(out_dir, "results.md"), "w", encoding="utf-8") as f:
    f.write(report.markdown(results))


def main(argv=None) -> int:
  args = parse_args(argv)
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


if __name__ == "__main__":
  sys.exit(main())
