"""A node lost mid-run under `jdist launch --max-restarts`: time to resume, accuracy, the epoch log.

    sudo .venv/bin/python -m benchmarks elastic_restart --nodes 2 --per-node 2 --epochs 6

`jdist train` on the rig, undisturbed, then with `--fault` on node B mid-epoch; one JSON line
per run (docs/multinode.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks.harness import cluster
from benchmarks.harness import rig_faults
from benchmarks.harness.section import Run, section


def train_args(epochs: int, batch: int, checkpoint_dir: str, log_file: str,
               every: int, extra=()) -> list[str]:
  return [cluster.tool("jdist"), "train", "--model", "cnn", "--dataset", "digits", "--epochs",
          str(epochs), "--batch-size", str(batch), "--no-progress", "--seed", "3",
          "--timeout", "30", "--checkpoint-dir", checkpoint_dir, "--checkpoint-every",
          str(every), "--resume", "--log-file", log_file, *extra]


def run_job(rig, per_node: int, train: list[str], *, fault_after_epoch: int | None = None,
            fault_delay_s: float = 1.0, fault: str = "link_down", max_restarts: int = 1,
            timeout: float = 240, env: dict | None = None) -> dict:
  """Runs `train` under `jdist launch` on `rig`, `fault` hitting node 1 `fault_delay_s` after
  epoch `fault_after_epoch`'s line; its exit code, output, `fault_at` and the seconds from
  the fault to the restarted run's "resumed from" line and to its next epoch.
  """
  job = rig_faults.RigJob(rig, train, per_node, ["--max-restarts", str(max_restarts)],
                          env or dict(os.environ), first=fault_after_epoch or 0,
                          faults=[f"{fault}:1"] if fault_after_epoch is not None else [],
                          delay=fault_delay_s)
  job.follow(timeout)
  fault_at = job.fault_times[0] if job.fault_times else None
  resumed_at = job.first_line("resumed from", fault_at)
  since = lambda t: None if fault_at is None or t is None else round(t - fault_at, 1)  # noqa: E731
  return {"code": job.code, "output": job.text, "fault_at": fault_at,
          "resumed_s": since(resumed_at),
          "next_epoch_s": since(job.first_line("epoch ", resumed_at))}


def read_log(path: str) -> tuple[list[dict], dict | None]:
  """(epoch records, the last summary) of a JSON-lines log."""
  records = rig_faults.read_jsonl(path)
  epochs = [r for r in records if r.get("event") == "epoch"]
  summaries = [r for r in records if r.get("event") == "summary"]
  return epochs, (summaries[-1] if summaries else None)


def log_problems(epochs: list[dict], expected: int) -> list[str]:
  """What makes an epoch log other than one record per epoch with steps one epoch apart."""
  problems = []
  numbers = [r.get("epoch") for r in epochs]
  if numbers != list(range(1, expected + 1)):
    problems.append(f"epochs {numbers}, expected 1..{expected} once each")
  steps = [r.get("step") for r in epochs]
  gaps = {b - a for a, b in zip(steps, steps[1:])}
  if steps and (len(gaps) > 1 or any(g <= 0 for g in gaps) or (gaps and steps[0] != min(gaps))):
    problems.append(f"steps {steps} do not grow by one epoch each")
  seen = {r.get("train_examples") for r in epochs}
  if len(seen) > 1:
    problems.append(f"examples per epoch differ: {[r.get('train_examples') for r in epochs]}")
  return problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--nodes", type=int, default=2)
  parser.add_argument("--per-node", type=int, default=2)
  parser.add_argument("--epochs", type=int, default=6)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--checkpoint-every", type=int, default=10)
  parser.add_argument("--fault-after-epoch", type=int, default=2)
  parser.add_argument("--rate-mbit", type=float, default=1000)
  parser.add_argument("--fault", choices=("link_down", "kill_node"), default="link_down")
  parser.add_argument("--skip-undisturbed", action="store_true")


def main(args: argparse.Namespace) -> int:
  for fault in ((None,) if not args.skip_undisturbed else ()) + (args.fault_after_epoch,):
    with tempfile.TemporaryDirectory() as tmp, \
         cluster.Cluster(nodes=args.nodes, rate_mbit=args.rate_mbit) as rig:
      log = os.path.join(tmp, "log.jsonl")
      train = train_args(args.epochs, args.batch_size, os.path.join(tmp, "ckpt"), log,
                         args.checkpoint_every)
      result = run_job(rig, args.per_node, train, fault_after_epoch=fault, fault=args.fault,
                       timeout=900)
      epochs, summary = read_log(log)
      row = {"fault": fault and args.fault, "fault_after_epoch": fault, "code": result["code"],
             "resumed_s": result["resumed_s"], "next_epoch_s": result["next_epoch_s"],
             "final_test_accuracy": summary and summary["final_test_accuracy"],
             "log_problems": log_problems(epochs, args.epochs),
             "steps": [r.get("step") for r in epochs],
             "examples": [r.get("train_examples") for r in epochs],
             "train_loss": [round(r.get("train_loss"), 6) for r in epochs],
             "restart_lines": [l for l in result["output"].splitlines() if "restart 1:" in l]}
      print(json.dumps(row), flush=True)
      if result["code"] != 0:
        print(result["output"][-4000:], file=sys.stderr)
  return 0


SECTION = section("elastic_restart", "a node lost mid-run under jdist launch --max-restarts",
                  rig=Run.of(sys.modules[__name__]))
