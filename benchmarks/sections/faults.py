"""Lost nodes on the rig: how long until every process of a job is gone, and what it says.

    python -m benchmarks faults --runs 5 --timeout 20 --out docs/benchmarks/cluster/faults.md

Each run: `jdist train` on 2 nodes x 2 processes under `jdist launch`, one fault on node B after
its first epoch (docs/multinode.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading

from benchmarks.harness import cluster
from benchmarks.harness import outputs
from benchmarks.harness import report
from benchmarks.harness import rig_faults
from benchmarks.harness.section import Run, UsageError, section

FAULTS = ("link_down", "kill_node", "partition")
PROCESSES_PER_NODE = 2


@dataclasses.dataclass
class FaultRun:
  fault: str
  exit_status: int | None
  seconds: float  # from the fault to jdist launch's exit
  names_host: bool  # "lost host nodeB (ranks 2, 3)" (or, in a partition, either side)
  leftover: int  # processes still on the nodes after the exit
  output: str


def run_fault(rig: cluster.Cluster, fault: str, timeout_s: float, env: dict[str, str],
              wait_s: float = 60) -> FaultRun:
  """One job on `rig` under `jdist launch`, with `fault` injected after its first epoch; the job
  is killed `timeout_s + wait_s` after the fault if it is still running.
  """
  kill = threading.Timer(1 + timeout_s + wait_s, lambda: os.killpg(job.proc.pid, signal.SIGKILL))
  job = rig_faults.RigJob(
      rig, [cluster.tool("jdist"), "train", "--epochs", "1000", "--batch-size", "8",
            "--no-progress", "--timeout", f"{timeout_s:g}"], PROCESSES_PER_NODE,
      ["-np", str(PROCESSES_PER_NODE * len(rig.nodes)), "--mpirun-args", "--map-by slot"], env,
      faults=[fault if fault == "partition" else f"{fault}:1"],
      on_line=lambda line: line.startswith("epoch 1/") and kill.ident is None and kill.start())
  try:
    ended = job.follow(3600)
  finally:
    kill.cancel()
  if not job.fault_times:
    raise RuntimeError("the job ended before its first epoch:\n" + job.text[-3000:])
  output = job.text
  names = ("lost host nodeB (ranks 2, 3)" in output if fault != "partition"
           else "lost host node" in output and "(ranks " in output)
  return FaultRun(fault, job.code, ended - job.fault_times[0], names,
                  len(rig.namespace_pids()), output)


def table(runs: list[FaultRun], timeout_s: float) -> str:
  """A Markdown table, one row per fault kind."""
  body = []
  for fault in FAULTS:
    mine = [r for r in runs if r.fault == fault]
    if not mine:
      continue
    seconds = sorted(r.seconds for r in mine)
    statuses = ", ".join(str(s) for s in sorted({r.exit_status for r in mine}, key=str))
    within = sum(r.seconds <= timeout_s + 15 and r.exit_status not in (0, None) for r in mine)
    body.append([fault, len(mine), f"{seconds[0]:.1f} / {seconds[len(seconds) // 2]:.1f} / "
                 f"{seconds[-1]:.1f}", statuses, f"{sum(r.names_host for r in mine)} of "
                 f"{len(mine)}", max(r.leftover for r in mine), f"{within} of {len(mine)}"])
  return "\n".join(report.table(
      ["fault", "runs", "seconds to exit (min / median / max)", "exit status",
       "names host + ranks", "processes left", "within timeout + 15 s"], body)).rstrip("\n")


def markdown(results: dict) -> str:
  """faults.md: what was run and `table` of `results["runs"]` (FaultRun) at `timeout_s`."""
  runs, timeout_s = results["runs"], results["timeout_s"]
  return (f"# Lost nodes on the rig\n\n`python -m benchmarks faults --runs {results['repeats']} "
          f"--timeout {timeout_s:g}`: 2 nodes x 2 processes x 1 device, 1 Gbit/s per node, "
          "`jdist train` under `jdist launch`, one fault per run after the first epoch (see "
          f"the module's docstring).\n\n{table(runs, timeout_s)}\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--timeout", type=float, default=20.0, help="jdist train --timeout")
  parser.add_argument("--faults", default=",".join(FAULTS))
  parser.add_argument("--out", help="Markdown file to write the table to")


def check(args: argparse.Namespace) -> None:
  unknown = [fault for fault in args.faults.split(",") if fault not in FAULTS]
  if unknown:
    raise UsageError(f"--faults {', '.join(unknown)}: choose kinds from {', '.join(FAULTS)} "
                     "(each hits node B; no target to add)")
  if args.runs < 1:
    raise UsageError(f"--runs {args.runs}: must be >= 1")


def main(args: argparse.Namespace) -> int:
  missing = cluster.missing_requirements()
  if missing:
    sys.stderr.write("cluster_faults: the rig cannot be built: " + "; ".join(missing) + "\n")
    return 1
  runs = []
  for _ in range(args.runs):
    for fault in args.faults.split(","):
      with cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
        run = run_fault(rig, fault, args.timeout, rig_faults.train_env())
      runs.append(run)
      print(f"{fault}: exit {run.exit_status} after {run.seconds:.1f} s, names host "
            f"{run.names_host}, {run.leftover} left", flush=True)
  print(table(runs, args.timeout))
  if args.out:
    outputs.write_markdown(args.out, markdown({"runs": runs, "repeats": args.runs,
                                               "timeout_s": args.timeout}))
  return 0


SECTION = section("faults", "lost nodes: time until a job is gone, and what it says",
                  rig=Run.of(sys.modules[__name__], report=markdown))
