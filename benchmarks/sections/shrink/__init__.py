"""`jdist launch --shrink` on the rig: time to go on after a fault, and ULFM's steady-state cost.

    python -m benchmarks shrink --on rig                 # docs/benchmarks/cluster/shrink.md
    python -m benchmarks shrink --quick --parts cost     # a smoke run (tests/test_fault_shrink.py)

Parts (`--parts`): `faults` (under `--shrink`), `restart` (`--max-restarts 1`), `shrink_restart`
(both), `cost` (ULFM on and off) and `chaos` (random kills); the runs: docs/multinode.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
from typing import Callable, Iterable

from benchmarks.harness import cluster
from benchmarks.harness import outputs
from benchmarks.harness import report
from benchmarks.harness import rig_faults
from benchmarks.harness.section import Run, section
from benchmarks.sections import elastic_restart
from benchmarks.sections.shrink import cost
from benchmarks.sections.shrink import faults

PARTS = ("faults", "restart", "shrink_restart", "cost", "chaos")
# Under --shrink --max-restarts: the node faults a shrink cannot survive, and a
# rank lost (shrunk past) before its node is (restarted past).
SHRINK_RESTART_FAULTS = ("kill_node:1", "link_down:1", "kill_rank:3+kill_node:1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--parts", default=",".join(PARTS), help=", ".join(PARTS))
  parser.add_argument("--faults", default=",".join(faults.FAULTS))
  parser.add_argument("--shrink-restart-faults", default=",".join(SHRINK_RESTART_FAULTS),
                      help="shrink_restart: faults under --shrink --max-restarts 1")
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--rounds", type=int, default=4, help="cost: alternated rounds")
  parser.add_argument("--steps", type=int, default=64,
                      help="cost: timed steps per run (whole agreement windows)")
  parser.add_argument("--chaos-faults", type=int, default=100, help="chaos: processes killed")
  parser.add_argument("--chaos-interval", type=float, default=8.0,
                      help="chaos: seconds between kills")
  parser.add_argument("--chaos-epochs", type=int, default=120,
                      help="chaos: epochs (enough to outlast the kills)")
  parser.add_argument("--chaos-restarts", type=int, default=0,
                      help="chaos: also --max-restarts N with checkpoints (0: none)")


def _rows(part: str, cases: Iterable, measure: Callable) -> list[dict]:
  """One row per case: `measure(case)` (a dataclass or a dict) with the load average before it."""
  rows = []
  for case in cases:
    load = os.getloadavg()[0]
    run = measure(case)
    rows.append(dict(run if isinstance(run, dict) else dataclasses.asdict(run), load=load))
    print(f"{part} {case}: {rows[-1]}", flush=True)
  return rows


def _restart(fault: str, epochs: int) -> dict:
  """`elastic_restart.run_job` with `fault` on node B after the first epoch."""
  with tempfile.TemporaryDirectory() as tmp, cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
    train = elastic_restart.train_args(epochs, 8, os.path.join(tmp, "ckpt"),
                                       os.path.join(tmp, "log.jsonl"), 10,
                                       extra=["--timeout", "20"])
    result = elastic_restart.run_job(rig, 2, train, fault_after_epoch=1, fault=fault,
                                     timeout=600, env=rig_faults.train_env())
  return {"fault": f"{fault}:1", "code": result["code"], "resumed_s": result["resumed_s"],
          "next_epoch_s": result["next_epoch_s"]}


def run_part(args: argparse.Namespace, part: str) -> list[dict]:
  """The rows of `part` (any but `cost`)."""
  env, limit = rig_faults.train_env(), 480 if args.quick else None
  chosen = lambda text: ["none"] + [f for f in text.split(",") if f]  # noqa: E731
  plans = {
      "faults": (chosen(args.faults), lambda fault: faults.run_shrink(
          fault, env, epochs=args.epochs, train_limit=limit)),
      "restart": (("kill_node", "link_down"), lambda fault: _restart(fault, args.epochs)),
      "shrink_restart": (chosen(args.shrink_restart_faults), lambda fault: faults.run_shrink(
          fault, env, epochs=args.epochs, restart=True, train_limit=limit)),
      "chaos": ((0, args.chaos_faults), lambda count: faults.run_chaos(  # undisturbed first
          count, env, epochs=args.chaos_epochs, interval=args.chaos_interval, timeout=7200,
          restarts=args.chaos_restarts))}
  return _rows(part, *plans[part])


def run_cost(args: argparse.Namespace) -> dict[str, list[dict]]:
  rounds, steps, warmup = (1, 10, 3) if args.quick else (args.rounds, args.steps, 8)
  env = rig_faults.train_env()
  print("cost, shared memory (2 processes on this host):", flush=True)
  found = {"shm": cost.alternate(cost.shm_starter(env), rounds, steps, warmup)}
  if not args.quick:
    print("cost, across the rig (2 nodes x 1 process):", flush=True)
    with cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
      found["rig"] = cost.alternate(cost.rig_starter(rig, env), rounds, steps, warmup)
  return found


def main(args: argparse.Namespace) -> int:
  parts = [p for p in args.parts.split(",") if p]
  unknown = set(parts) - set(PARTS)
  if unknown:
    sys.stderr.write(f"shrink: unknown parts {sorted(unknown)}; choose from {PARTS}\n")
    return 2
  if {"faults", "restart", "shrink_restart", "chaos"} & set(parts) or not args.quick:
    missing = cluster.missing_requirements()
    if missing:
      sys.stderr.write("shrink: the rig cannot be built: " + "; ".join(missing) + "\n")
      return 1
  results = {"command": args.command, "quick": args.quick, "epochs": args.epochs,
             "chaos_epochs": args.chaos_epochs}
  for part in PARTS:
    if part in parts:
      results[part] = run_cost(args) if part == "cost" else run_part(args, part)
  names = outputs.write_report(args.out, results, markdown, json_name="shrink.json",
                               md_name="shrink.md")
  print(f"wrote {', '.join(os.path.join(args.out, n) for n in names)}")
  return 0


def _seconds(value) -> str:
  return "-" if value is None else f"{value:.2f} s"


def _result_cells(row: dict) -> tuple[str, str, str]:
  """A run's final test accuracy, train loss per epoch, and steps and replicas at the end."""
  accuracy = "-" if row["test_accuracy"] is None else f"{row['test_accuracy']:.2%}"
  losses = ", ".join(f"{e[0]:.6f}" for e in row.get("epochs") or []) or "-"
  kept = "-" if row["steps"] is None else f"{row['steps']}, {row['replicas']}"
  return accuracy, losses, kept


def _fault_rows(rows: list[dict]) -> list[str]:
  cells = []
  for row in rows:
    accuracy, losses, kept = _result_cells(row)
    why = row["why"].replace("|", ";")  # a cell of its own table
    ended = _seconds(row["ended_s"]) + (f" ({why})" if why else "")
    resumed = (", ".join(_seconds(v) for v in row["resumed_s"]) if len(row.get("resumed_s") or [])
               > 1 else _seconds(row["fault_to_resumed_s"]))
    cells.append([row["fault"], str(row["code"]), _seconds(row["fault_to_detected_s"]),
                  f"**{resumed}**", ended, str(row["lost_ranks"] or "-"), kept, accuracy, losses,
                  f"{row['load']:.1f}"])
  return report.table(["fault", "exit", "fault -> detected", "fault -> next completed step",
                 "fault -> job ended (not survived)", "lost ranks", "steps, replicas at the end",
                 "final test accuracy", "train loss per epoch", "load"], cells)


def _shrink_restart_rows(rows: list[dict]) -> list[str]:
  cells = []
  for row in rows:
    accuracy, losses, kept = _result_cells(row)
    cells.append([row["fault"], str(row["code"]), str(row["lost_ranks"] or "-"),
                  str(row["restarts"]), _seconds(row["fault_to_restarted_s"]),
                  f"**{_seconds(row.get('fault_to_first_step_s'))}**",
                  _seconds(row["fault_to_next_epoch_s"]), kept, accuracy, losses,
                  f"{row['load']:.1f}"])
  return report.table(["faults", "exit", "shrunk past (lost ranks)", "restarts",
                 'last fault -> "resumed from step"', "last fault -> first step after it",
                 "last fault -> next epoch done",
                 "steps, replicas at the end", "final test accuracy", "train loss per epoch",
                 "load"], cells)


def _cost_rows(found: dict[str, list[dict]]) -> list[str]:
  body = []
  for placement, records in found.items():
    for config in cost.CONFIGS:
      mine = [r for r in records if r["config"] == config]
      if mine:
        body.append([placement, config, len(mine),
                     f"{statistics.median(r['step_s'] for r in mine) * 1e3:.1f}",
                     f"{statistics.median(r['exchange_s'] for r in mine) * 1e3:.1f}",
                     f"{min(r['load'] for r in mine):.1f}-{max(r['load'] for r in mine):.1f}"])
    step, exchange = cost.ratios(records), cost.ratios(records, "exchange_s")
    body.append([placement, "**ratio** (median of per-round ratios)", "",
                 ", ".join(f"{k} {v:.3f}" for k, v in step.items()),
                 ", ".join(f"{k} {v:.3f}" for k, v in exchange.items()), ""])
  return report.table(["placement", "config", "runs", "mean step (ms), median of runs",
                       "mean exchange (ms), median of runs", "loads"], body)


def _chaos_rows(rows: list[dict]) -> list[str]:
  calm = rows[0]["wall_s"] if rows and rows[0]["kills"] == 0 else None
  median = lambda values: _seconds(statistics.median(values)) if values else "-"  # noqa: E731
  body = []
  for row in rows:
    accuracy = "-" if row["test_accuracy"] is None else f"{row['test_accuracy']:.2%}"
    goodput = cost_per = "-"
    # Goodput against the undisturbed run only where the job ended as it did
    # (on fewer replicas, 2 shared cores run each step faster: no comparison).
    finished = (row["code"] == 0 and row["steps"] == rows[0]["steps"]
                and row["replicas"] == rows[0]["replicas"])
    if calm and row["wall_s"] and row["kills"] and finished:
      goodput = f"{calm / row['wall_s']:.1%}"
      cost_per = _seconds((row["wall_s"] - calm) / row["kills"])
    body.append([row["kills"], row["code"], row["hung"], row["shrinks"], row["grows"],
                 row.get("restarts", 0), row["digests_equal"], median(row["resumed_s"]),
                 f"{median(row['grow_s'])} ({median(row.get('take_in_s'))})",
                 f"{row['steps']}, {row['replicas']}", accuracy, _seconds(row["wall_s"]),
                 goodput, cost_per, f"{row['load']:.1f}"])
  return report.table(
      ["kills", "exit", "hung", "shrinks", "grows", "restarts",
       "replicas bit-identical after each", "median detected -> next step",
       "median growth: started -> joined (the members' part)", "steps, replicas at the end",
       "final test accuracy", "wall", "goodput", "cost per kill", "load"], body)


def markdown(results: dict) -> str:
  """shrink.md: the runs' tables (see the module's docstring for what each part does)."""
  text = [f"# `jdist launch --shrink` on the rig\n\n`{results['command']}`"
          + (" (quick: a smoke run, not a measurement)" if results.get("quick") else "")
          + "; 2 nodes x 2 processes x 1 device, 1 Gbit/s per node, the digits CNN, "
          f"{results['epochs']} epochs"
          + (f" ({results['chaos_epochs']} in the chaos runs)" if "chaos" in results else "")
          + ", `--timeout 20`.\n"]
  if results.get("note"):  # added by hand to a sitting's JSON (then re-rendered)
    text.append(results["note"] + "\n")
  restarts = [[r["fault"], r["code"], _seconds(r["resumed_s"]), _seconds(r["next_epoch_s"]),
               f"{r['load']:.1f}"] for r in results.get("restart", [])]
  for part, title, rows in (
      ("faults", "`--shrink`: fault -> the survivors' next completed step", _fault_rows),
      ("restart", "`--max-restarts 1` (no `--shrink`), the same sitting", lambda _: report.table(
          ["fault", "exit", 'fault -> "resumed from"', "fault -> next epoch done", "load"],
          restarts)),
      ("shrink_restart", "`--shrink --max-restarts 1`, checkpoints every 8 steps: a lost node "
       "restarts, a lost rank is shrunk past", _shrink_restart_rows),
      ("cost", "ULFM's steady-state cost (`steploop`, alternated)", _cost_rows),
      ("chaos", "Chaos: random kills, `--max-np 4` (the job grows back after each)",
       _chaos_rows)):
    if part in results:
      text += [f"## {title}\n", *rows(results[part])]
  return "\n".join(text) + "\n"


SECTION = section("shrink", "jdist launch --shrink through faults on the rig; ULFM's cost",
                  rig=Run.of(sys.modules[__name__], report=markdown,
                             out="docs/benchmarks/cluster", quick=True))
