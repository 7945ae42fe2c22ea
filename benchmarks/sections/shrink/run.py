"""`jdist launch --shrink` on the rig: time to go on after a fault, and ULFM's steady-state cost.

    python -m benchmarks shrink --on rig                 # docs/benchmarks/cluster/shrink.md
    python -m benchmarks shrink --quick --parts cost     # a smoke run (tests/test_fault_shrink.py)

Parts (`--parts`, comma-separated; all by default):

  * `faults`: an undisturbed `jdist train --shrink` on 2 nodes x 2 processes,
    then one run per fault of `--faults` (`faults.FAULTS`: kill rank 3, kill
    rank 0, kill node B, kill node A, node B's link down), each a second
    after the first epoch: fault -> detected -> the survivors' next
    completed step (the JSON log's "shrink" record), or fault -> the job's
    end where it did not survive;
  * `restart`: the same job under `jdist launch --max-restarts 1` (no
    `--shrink`, checkpoints every 10 steps, `benchmarks.sections.elastic_restart`),
    node B killed and node B's link down: fault -> "resumed from";
  * `shrink_restart`: the job under `jdist launch --shrink --max-restarts 1`
    with checkpoints every 8 steps (`--resume`), undisturbed, then one run
    per fault of `--shrink-restart-faults` (node B killed, node B's link
    down, rank 3 killed then node B): a lost rank is shrunk past, a lost
    node ends the run and the job starts again on node A from the newest
    checkpoint: last fault -> "resumed from step", -> its next epoch line;
  * `cost`: `steploop` alternated under ULFM on and off (`cost.py`), on
    shared memory and across the rig's nodes;
  * `chaos`: `--chaos-faults` random kills under `--max-np 4`, one every
    `--chaos-interval` seconds, the job growing back after each (`chaos.py`),
    beside the same job undisturbed.

Every row carries the machine's load average when it ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

from benchmarks.harness import cluster
from benchmarks.harness import outputs
from benchmarks.sections import elastic_restart
from benchmarks.sections.shrink import chaos
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


def _env() -> dict[str, str]:
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
              PYTHONPATH=os.pathsep.join(filter(None, [faults._REPO,  # pylint: disable=protected-access
                                                       os.environ.get("PYTHONPATH")])),
              XLA_FLAGS="--xla_force_host_platform_device_count=1")


def run_faults(args: argparse.Namespace) -> list[dict]:
  rows = []
  for fault in ["none"] + [f for f in args.faults.split(",") if f]:
    load = os.getloadavg()[0]
    run = faults.run_shrink(fault, _env(), epochs=args.epochs,
                            train_limit=480 if args.quick else None)
    rows.append(dict(dataclasses.asdict(run), load=load))
    print(f"shrink {fault}: {rows[-1]}", flush=True)
  return rows


def run_restarts(args: argparse.Namespace) -> list[dict]:
  rows = []
  for fault in ("kill_node", "link_down"):
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
      train = elastic_restart.train_args(args.epochs, 8, os.path.join(tmp, "ckpt"),
                                         os.path.join(tmp, "log.jsonl"), 10,
                                         extra=["--timeout", "20"])
      result = elastic_restart.run_job(rig, 2, train, fault_after_epoch=1, fault=fault,
                                       timeout=600, env=_env())
    rows.append({"fault": f"{fault}:1", "code": result["code"], "load": load,
                 "resumed_s": result["resumed_s"], "next_epoch_s": result["next_epoch_s"]})
    print(f"restart {fault}: {rows[-1]}", flush=True)
  return rows


def run_shrink_restarts(args: argparse.Namespace) -> list[dict]:
  rows = []
  for fault in ["none"] + [f for f in args.shrink_restart_faults.split(",") if f]:
    load = os.getloadavg()[0]
    run = faults.run_shrink(fault, _env(), epochs=args.epochs, restart=True,
                            train_limit=480 if args.quick else None)
    rows.append(dict(dataclasses.asdict(run), load=load))
    print(f"shrink_restart {fault}: {rows[-1]}", flush=True)
  return rows


def run_chaos(args: argparse.Namespace) -> list[dict]:
  rows = []
  for count in (0, args.chaos_faults):  # undisturbed first: goodput's reference
    load = os.getloadavg()[0]
    run = chaos.run_chaos(count, _env(), epochs=args.chaos_epochs,
                          interval=args.chaos_interval, timeout=7200,
                          restarts=args.chaos_restarts)
    rows.append(dict(dataclasses.asdict(run), load=load))
    print(f"chaos {count}: {rows[-1]}", flush=True)
  return rows


def run_cost(args: argparse.Namespace) -> dict[str, list[dict]]:
  rounds, steps, warmup = (1, 10, 3) if args.quick else (args.rounds, args.steps, 8)
  env = _env()
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
  if "faults" in parts:
    results["faults"] = run_faults(args)
  if "restart" in parts:
    results["restart"] = run_restarts(args)
  if "shrink_restart" in parts:
    results["shrink_restart"] = run_shrink_restarts(args)
  if "cost" in parts:
    results["cost"] = run_cost(args)
  if "chaos" in parts:
    results["chaos"] = run_chaos(args)
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


def _table(columns: list[str], cells: list[list[str]]) -> list[str]:
  """A markdown table's lines."""
  return ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
          *("| " + " | ".join(row) + " |" for row in cells)]


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
  return _table(["fault", "exit", "fault -> detected", "fault -> next completed step",
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
  return _table(["faults", "exit", "shrunk past (lost ranks)", "restarts",
                 'last fault -> "resumed from step"', "last fault -> first step after it",
                 "last fault -> next epoch done",
                 "steps, replicas at the end", "final test accuracy", "train loss per epoch",
                 "load"], cells)


def _cost_rows(found: dict[str, list[dict]]) -> list[str]:
  lines = ["| placement | config | runs | mean step (ms), median of runs | mean exchange (ms), median of runs | "
           "loads |", "| --- | --- | --- | --- | --- | --- |"]
  for placement, records in found.items():
    for config in cost.CONFIGS:
      mine = [r for r in records if r["config"] == config]
      if mine:
        lines.append(
            f"| {placement} | {config} | {len(mine)} | "
            f"{statistics.median(r['step_s'] for r in mine) * 1e3:.1f} | "
            f"{statistics.median(r['exchange_s'] for r in mine) * 1e3:.1f} | "
            f"{min(r['load'] for r in mine):.1f}-{max(r['load'] for r in mine):.1f} |")
    step, exchange = cost.ratios(records), cost.ratios(records, "exchange_s")
    lines.append(f"| {placement} | **ratio** (median of per-round ratios) | | "
                 + ", ".join(f"{k} {v:.3f}" for k, v in step.items()) + " | "
                 + ", ".join(f"{k} {v:.3f}" for k, v in exchange.items()) + " | |")
  return lines


def _chaos_rows(rows: list[dict]) -> list[str]:
  lines = ["| kills | exit | hung | shrinks | grows | restarts | replicas bit-identical after each | "
           "median detected -> next step | median growth: started -> joined (the members' "
           "part) | steps, replicas at the end | final test accuracy | wall | goodput | cost "
           "per kill | load |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  calm = rows[0]["wall_s"] if rows and rows[0]["kills"] == 0 else None
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
    median = lambda values: _seconds(statistics.median(values)) if values else "-"  # pylint: disable=unnecessary-lambda-assignment
    lines.append(f"| {row['kills']} | {row['code']} | {row['hung']} | {row['shrinks']} | "
                 f"{row['grows']} | {row.get('restarts', 0)} | {row['digests_equal']} | "
                 f"{median(row['resumed_s'])} | "
                 f"{median(row['grow_s'])} ({median(row.get('take_in_s'))}) | "
                 f"{row['steps']}, {row['replicas']} | {accuracy} | "
                 f"{_seconds(row['wall_s'])} | {goodput} | {cost_per} | {row['load']:.1f} |")
  return lines


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
  if "faults" in results:
    text += ["## `--shrink`: fault -> the survivors' next completed step\n",
             *_fault_rows(results["faults"]), ""]
  if "restart" in results:
    text += ["## `--max-restarts 1` (no `--shrink`), the same sitting\n",
             "| fault | exit | fault -> \"resumed from\" | fault -> next epoch done | load |",
             "| --- | --- | --- | --- | --- |",
             *(f"| {r['fault']} | {r['code']} | {_seconds(r['resumed_s'])} | "
               f"{_seconds(r['next_epoch_s'])} | {r['load']:.1f} |" for r in results["restart"]),
             ""]
  if "shrink_restart" in results:
    text += ["## `--shrink --max-restarts 1`, checkpoints every 8 steps: a lost node restarts, "
             "a lost rank is shrunk past\n", *_shrink_restart_rows(results["shrink_restart"]), ""]
  if "cost" in results:
    text += ["## ULFM's steady-state cost (`steploop`, alternated)\n",
             *_cost_rows(results["cost"]), ""]
  if "chaos" in results:
    text += ["## Chaos: random kills, `--max-np 4` (the job grows back after each)\n",
             *_chaos_rows(results["chaos"]), ""]
  return "\n".join(text) + "\n"
