"""Faults under `jdist launch --shrink` on the rig, and the `--max-restarts` restart beside them.

`run_shrink` starts `jdist train --shrink` on 2 nodes x 2 processes (ranks
0, 1 on node A, 2, 3 on node B), waits for its first epoch, injects one
fault a second later and reads the JSON log's {"event": "shrink"} record:
the seconds from the fault to `detected_at` and to `resumed_at` (the
survivors' next completed step). A fault the job does not survive is timed
from the fault to `jdist launch`'s exit, with the line that says why.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading

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
  """One `jdist launch --shrink` job on a fresh 2-node rig, `fault` after its first epoch.

  With `restart`, under `--max-restarts 1` with checkpoints every 8 steps
  (`--resume`): what a lost node ends starts again on the healthy node.
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
    job = rig_faults.launch(rig, command, PER_NODE, flags, env)
    chain = [] if fault == "none" else fault.split("+")  # the i-th after epoch i's line
    times: list[float] = []

    def on_line(line: str) -> None:
      epoch = line.startswith("epoch ") and line.split()[1].split("/")[0]
      if epoch and epoch.isdigit() and 1 <= int(epoch) <= len(chain):
        hit = chain[int(epoch) - 1]
        threading.Timer(1.0, lambda: times.append(rig_faults.inject(rig, hit))).start()

    output = rig_faults.Output(job, on_line)
    ended = output.follow(timeout)
    run = _outcome(ShrinkRun(fault, job.returncode), rig_faults.read_jsonl(log), times, ended,
                   output.text)
    if restart:
      _restart_times(run, output.stamped, times)
    return run
