"""A chaos run of `jdist launch --shrink --max-np`: many processes killed, the job grows back each time.

`run_chaos` kills one training process at random (any node, rank 0 among them) every
`interval` seconds from the first epoch on, up to `count` kills; each is shrunk past
and a process started in its place. Goodput is the undisturbed run's wall time over
the chaos run's for the same steps (so it depends on the kill rate); the cost per
kill, (chaos - undisturbed) / kills, gives it at another rate.
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
from benchmarks.sections.shrink import faults


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
  """The job's training processes on the rig (`python .../jdist train --shrink`; not mpirun
  nor `jdist launch`, whose command lines hold the same words)."""
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
  """One `--shrink --max-np 4` job on a fresh rig with `count` random kills.

  With `restarts`, also `--max-restarts` with checkpoints every 8 steps and
  no cooldown: a run that PRRTE ends (it lost a node's daemon among the
  deaths and spawns) starts again on both nodes from the newest checkpoint.
  """
  with tempfile.TemporaryDirectory() as tmp, \
       cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
    log = os.path.join(tmp, "log.jsonl")
    processes = 2 * faults.PER_NODE
    command = faults.train_command(log, epochs, None)
    flags = ["--shrink", "-np", str(processes), "--max-np", str(processes),
             "--mpirun-args", "--map-by slot --oversubscribe"]
    if restarts:
      command += ["--checkpoint-dir", os.path.join(tmp, "ckpt"), "--checkpoint-every", "8",
                  "--resume"]
      flags += ["--max-restarts", str(restarts), "--cooldown", "0"]
    job = rig_faults.launch(rig, command, faults.PER_NODE, flags, env)
    stop, kills, began = threading.Event(), [], time.time()

    def on_line(line: str) -> None:
      if count and not kills_started.is_set() and line.startswith("epoch 1/"):
        kills_started.set()
        threading.Thread(target=_killer, args=(rig, count, interval, stop, kills),
                         daemon=True).start()

    kills_started = threading.Event()
    output = rig_faults.Output(job, on_line)
    try:
      wall, hung = output.follow(timeout) - began, False
    except subprocess.TimeoutExpired:
      wall, hung = None, True
    stop.set()
    said = [line for line in output.lines if line.strip() and not line.startswith("NBC_Progress")]
    tail = "" if job.returncode == 0 else "".join(said[-60:])
    restarted = sum(1 for line in output.lines if line.startswith("jdist launch: restart "))
    return _outcome(ChaosRun(count, job.returncode, hung, kills=len(kills), wall_s=wall,
                             tail=tail, restarts=restarted), rig_faults.read_jsonl(log))


def _outcome(run: ChaosRun, records: list[dict]) -> ChaosRun:
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
