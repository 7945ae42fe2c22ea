"""Faults under `jdist launch --shrink` on the rig (`run_shrink`: fault -> detected -> resumed,
or -> the job's end) and chaos runs (`run_chaos`, docs/multinode.md#chaos-run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import tempfile
import threading
import time

from benchmarks.harness import cluster
from benchmarks.harness import rig_faults

PER_NODE = 2
# `rig_faults.inject`'s "kind:target"; "A+B+C": A after the first epoch, B after the second, ...
FAULTS = ("kill_rank:3", "kill_rank:0", "kill_node:1", "kill_node:0", "link_down:1")
_WHY = ("lost communication", "failed to report back", "jdist launch: the job failed")


@dataclasses.dataclass
class ShrinkRun:
  """One `--shrink` job on the rig and what its fault did."""
  fault: str  # "none" for the undisturbed run
  code: int | None
  fault_to_detected_s: float | None = None
  fault_to_resumed_s: float | None = None
  ended_s: float | None = None  # fault -> jdist launch's exit, when no shrink happened
  why: str = ""  # the lines that say why the job ended, when it did not shrink
  test_accuracy: float | None = None
  replicas: int | None = None
  steps: int | None = None
  lost_ranks: list | None = None
  digest: str | None = None  # the final parameters' digest (runs agree bit for bit or not)
  epochs: list | None = None  # per epoch: [train loss, test accuracy, replicas]
  resumed_s: list | None = None  # a chain's faults: each fault -> its next completed step
  # With --max-restarts (`restart=True`): the last fault -> the restarted run's
  # "resumed from step S" line, -> its first completed step, -> its first epoch line.
  restarts: int | None = None
  fault_to_restarted_s: float | None = None
  fault_to_first_step_s: float | None = None
  fault_to_next_epoch_s: float | None = None


def train_command(log: str, epochs: int, train_limit: int | None) -> list[str]:
  """The `jdist train --shrink` the section runs (the main job's CNN on digits)."""
  command = [cluster.tool("jdist"), "train", "--shrink", "--model", "cnn", "--dataset",
             "digits", "--batch-size", "16", "--lr", "0.05", "--momentum", "0.9",
             "--epochs", str(epochs), "--seed", "3", "--timeout", "20", "--no-progress",
             "--log-file", log]
  return command + (["--train-limit", str(train_limit)] if train_limit else [])


def _restart_times(run: ShrinkRun, stamped: list[tuple[float, str]], times: list[float]) -> None:
  """The restart's times, from the job's lines stamped with when they came."""
  run.restarts = sum(1 for _, line in stamped if line.startswith("jdist launch: restart "))
  after = [(at, line) for at, line in stamped if times and at >= times[-1]]
  resumed = [at for at, line in after if "resumed from step" in line]
  if resumed:
    run.fault_to_restarted_s = resumed[0] - times[-1]
    stepped = [at for at, line in after if "first step after the restart done" in line]
    run.fault_to_first_step_s = stepped[0] - times[-1] if stepped else None
    epochs = [at for at, line in after if at > resumed[0] and line.startswith("epoch ")]
    run.fault_to_next_epoch_s = epochs[0] - times[-1] if epochs else None


def _outcome(run: ShrinkRun, records: list[dict], times: list[float],
             ended_at: float, output: str) -> ShrinkRun:
  """Fills `run` from the log's records, the faults' times and the job's output."""
  fault_at = times[0] if times else None
  shrinks = [r for r in records if r.get("event") == "shrink"]
  summaries = [r for r in records if r.get("event") == "summary"]
  if summaries:
    run.test_accuracy, run.replicas = summaries[-1]["test_accuracy"], summaries[-1]["replicas"]
    run.steps, run.digest = summaries[-1]["steps"], summaries[-1]["params_digest"]
  run.epochs = [[r["train_loss"], r["test_accuracy"], r["replicas"]]
                for r in records if r.get("event") == "epoch"]
  if shrinks and fault_at is not None:
    run.fault_to_detected_s = shrinks[0]["detected_at"] - fault_at
    run.fault_to_resumed_s = shrinks[0]["resumed_at"] - fault_at
    run.lost_ranks = sorted(r for s in shrinks for r in s["lost_ranks"])
    run.resumed_s = [s["resumed_at"] - t for s, t in zip(shrinks, times)]
  elif fault_at is not None:
    run.ended_s = ended_at - fault_at
    why = [line.strip() for line in output.splitlines() if any(w in line for w in _WHY)]
    run.why = "".join(c for c in " | ".join(why) if c.isprintable())[:400]
  return run


def run_shrink(fault: str, env: dict[str, str], *, epochs: int = 3,
               train_limit: int | None = None, timeout: float = 600,
               restart: bool = False) -> ShrinkRun:
  """One `jdist launch --shrink` job on a fresh 2-node rig, `fault` after its first epoch (with
  `restart`: `--max-restarts 1`, checkpoints every 8 steps, `--resume`).
  """
  with tempfile.TemporaryDirectory() as tmp, \
       cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
    log = os.path.join(tmp, "log.jsonl")
    command = train_command(log, epochs, train_limit)
    flags = ["--shrink", "-np", str(2 * PER_NODE), "--mpirun-args", "--map-by slot"]
    if restart:
      command += ["--checkpoint-dir", os.path.join(tmp, "ckpt"), "--checkpoint-every", "8",
                  "--resume"]
      flags += ["--max-restarts", "1", "--cooldown", "600"]
    job = rig_faults.RigJob(rig, command, PER_NODE, flags, env,
                            faults=[] if fault == "none" else fault.split("+"))
    ended = job.follow(timeout)
    times = job.fault_times
    run = _outcome(ShrinkRun(fault, job.code), rig_faults.read_jsonl(log), times, ended, job.text)
    if restart:
      _restart_times(run, job.stamped, times)
    return run


@dataclasses.dataclass
class ChaosRun:
  """What one chaos job did (`faults` = 0: the undisturbed run)."""
  faults: int
  code: int | None
  hung: bool
  kills: int = 0
  shrinks: int = 0
  grows: int = 0
  digests_equal: bool | None = None  # after every shrink and growth
  resumed_s: list | None = None  # each shrink: detected -> next completed step
  grow_s: list | None = None  # each growth: start -> state handed over
  take_in_s: list | None = None  # each growth: ready -> state handed over (the members' stall)
  steps: int | None = None
  replicas: int | None = None
  test_accuracy: float | None = None
  wall_s: float | None = None  # jdist launch's start -> exit, measured here
  tail: str = ""  # the job's last output lines, when it did not finish
  restarts: int = 0  # runs PRRTE ended (a node's daemon lost), started again from a checkpoint


def training_pids(rig: cluster.Cluster) -> list[int]:
  """The job's training processes on the rig (not mpirun nor jdist launch)."""
  return rig_faults.pids_where(rig, lambda argv: (
      os.path.basename(argv[0]).startswith(b"python") and b"launch" not in argv
      and b"train" in argv and b"--shrink" in argv))


def _killer(rig, count: int, interval: float, stop: threading.Event, kills: list) -> None:
  chooser = random.Random(0)
  while len(kills) < count and not stop.wait(interval):
    pids = training_pids(rig)
    if len(pids) < 2:  # a growth under way: leave a survivor
      continue
    victim = chooser.choice(pids)
    with contextlib.suppress(ProcessLookupError):
      os.kill(victim, signal.SIGKILL)
      kills.append(time.time())


def run_chaos(count: int, env: dict[str, str], *, epochs: int, interval: float,
              timeout: float, restarts: int = 0) -> ChaosRun:
  """One `--shrink --max-np 4` job on a fresh rig with `count` random kills (with `restarts`,
  also `--max-restarts` from checkpoints every 8 steps, no cooldown).
  """
  with tempfile.TemporaryDirectory() as tmp, \
       cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
    log = os.path.join(tmp, "log.jsonl")
    processes = 2 * PER_NODE
    command = train_command(log, epochs, None)
    flags = ["--shrink", "-np", str(processes), "--max-np", str(processes),
             "--mpirun-args", "--map-by slot --oversubscribe"]
    if restarts:
      command += ["--checkpoint-dir", os.path.join(tmp, "ckpt"), "--checkpoint-every", "8",
                  "--resume"]
      flags += ["--max-restarts", str(restarts), "--cooldown", "0"]
    stop, kills, began = threading.Event(), [], time.time()
    killer = threading.Thread(target=_killer, args=(rig, count, interval, stop, kills),
                              daemon=True)

    def on_line(line: str) -> None:
      if count and killer.ident is None and line.startswith("epoch 1/"):
        killer.start()

    job = rig_faults.RigJob(rig, command, PER_NODE, flags, env, on_line=on_line)
    try:
      wall, hung = job.follow(timeout) - began, False
    except subprocess.TimeoutExpired:
      wall, hung = None, True
    stop.set()
    said = [line for line in job.lines if line.strip() and not line.startswith("NBC_Progress")]
    tail = "" if job.code == 0 else "".join(said[-60:])
    restarted = sum(1 for line in job.lines if line.startswith("jdist launch: restart "))
    return _chaos_outcome(ChaosRun(count, job.code, hung, kills=len(kills), wall_s=wall,
                             tail=tail, restarts=restarted), rig_faults.read_jsonl(log))


def _chaos_outcome(run: ChaosRun, records: list[dict]) -> ChaosRun:
  shrinks = [r for r in records if r.get("event") == "shrink"]
  grows = [r for r in records if r.get("event") == "grow"]
  run.shrinks, run.grows = len(shrinks), len(grows)
  run.digests_equal = all(r["digests_equal"] for r in shrinks + grows)
  run.resumed_s = [round(r["resumed_at"] - r["detected_at"], 3) for r in shrinks]
  run.grow_s = [round(r["joined_at"] - r["started_at"], 3) for r in grows]
  run.take_in_s = [round(r["joined_at"] - r.get("ready_at", r["started_at"]), 3) for r in grows]
  summaries = [r for r in records if r.get("event") == "summary"]
  if summaries:
    last = summaries[-1]
    run.steps, run.replicas = last["steps"], last["replicas"]
    run.test_accuracy = last["test_accuracy"]
  return run
