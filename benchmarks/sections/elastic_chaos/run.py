"""Chaos: one `jdist train` under `jdist launch --max-restarts 30` through many faults.

    sudo .venv/bin/python -m benchmarks elastic_chaos --faults 20

The digits CNN on the 2-node rig (one process per node) with persistent and local
checkpoints; whenever the job has saved since it (re)started, the next fault of
`CYCLE` hits it, and a host left out comes back after `--cooldown`. Beside it the
same schedule is replayed without faults, every checkpoint of both is copied as it
appears (`checkpoints`) and the two are compared at every step both saved (target
1e-5). Prints one JSON line. The run: docs/multinode.md (chaos run).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.harness import cluster
from benchmarks.harness import jobs
from benchmarks.harness import rig_faults
from benchmarks.sections.elastic_chaos import checkpoints as chaos_checkpoints
from tests import launch as test_launch

CYCLE = ("link_down", "kill_rank", "kill_node", "kill_rank")
# Searched, not matched: the launcher's stderr and the ranks' stdout share one pipe,
# so a line may start with another's unfinished output.
_TRAIN = re.compile(r"jdist train: \w+ \([\d,]+ parameters\)")
_RESUMED = re.compile(r"resumed from (\S+) step (\d+)")
_SAVED = re.compile(r"checkpoint saved at step (\d+)")
_WORLD = re.compile(r"process \d+/(\d+)")
REPLAY_BINDING = ["--bind-to", "core"]


def resumed_step(output: str) -> int | None:
  """The step a `jdist train` run says it resumed from (0: from scratch; None: neither)."""
  found = _RESUMED.search(output)
  if found:
    return int(found.group(2))
  return 0 if "starting from scratch" in output else None


def train_args(args, checkpoint_dir: str) -> list[str]:
  return [cluster.tool("jdist"), "train", "--model", "cnn", "--dataset", "digits",
          "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
          "--train-limit", str(args.train_limit), "--eval-every", "0", "--no-progress",
          "--seed", "3", "--timeout", "30", "--checkpoint-dir", checkpoint_dir,
          "--checkpoint-every", str(args.checkpoint_every), "--resume"]


def training_pids(rig) -> list[int]:
  """The `jdist train` processes: node A's are children of its prted too."""
  return rig_faults.pids_where(rig, lambda words: b"train" in words and any(
      w.endswith(b"jdist") for w in words))


def cpus_allowed(pid: int) -> str | None:
  """The CPUs a process may run on (/proc's Cpus_allowed_list), or None if it is gone."""
  try:
    with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
      return next((line.split(":", 1)[1].strip() for line in handle
                   if line.startswith("Cpus_allowed_list")), None)
  except OSError:
    return None


def _new_run() -> dict:
  """A run of the job: the step it resumed from (None: it trained nothing), its
  processes and its newest persistent checkpoint."""
  return {"resumed": None, "world": None, "saved": None, "tier": None, "cpus": None}


class Chaos:
  """Reads the job's output; injects the faults; keeps the schedule."""

  def __init__(self, rig, args):
    self.rig, self.args = rig, args
    self.lines: list[str] = []
    self.runs = [_new_run()]
    self.faults: list[dict] = []
    self.grows = self.hangs = self.corrupt = 0
    self.lock = threading.Lock()
    self.fault_at: float | None = None
    self.link_is_down = False

  def read(self, stream) -> None:
    for line in stream:
      with self.lock:
        self.lines.append(line)
        self.take(line)

  def take(self, line: str) -> None:
    if _TRAIN.search(line):
      world = _WORLD.search(line)
      self.runs[-1]["world"] = int(world.group(1)) if world else None
    elif _RESUMED.search(line):
      resumed = _RESUMED.search(line)
      self.runs[-1]["resumed"] = int(resumed.group(2))
      self.runs[-1]["tier"] = "local" if "jdist-local" in resumed.group(1) else "persistent"
    elif "starting from scratch" in line:
      self.runs[-1]["resumed"] = 0
    elif _SAVED.search(line):
      self.runs[-1]["saved"] = int(_SAVED.search(line).group(1))
    elif "jdist launch: restart " in line:
      self.runs.append(_new_run())  # the next run: nothing hits it before it has saved
      self.fault_at = None  # the launcher went on
      if "is back" in line:
        self.grows += 1
      if self.link_is_down:
        self.rig.set_link(1, "up")
        self.link_is_down = False
    if "cannot be read" in line:
      self.corrupt += 1

  def inject(self, kind: str) -> bool:
    if kind == "link_down":
      if self.runs[-1]["world"] == 1:
        return False  # node B is not in the job
      self.rig.link_down(1)
      self.link_is_down = True
    elif kind == "kill_node":
      if self.runs[-1]["world"] == 1:
        return False
      self.rig.kill_node(1)
    else:
      pids = training_pids(self.rig)
      if not pids:
        return False
      os.kill(pids[len(self.faults) % len(pids)], signal.SIGKILL)
    self.faults.append({"kind": kind, "at_step": self.runs[-1]["saved"],
                        "world": self.runs[-1]["world"]})
    self.fault_at = time.monotonic()
    return True

  def drive(self, job: subprocess.Popen) -> None:
    kinds = 0
    while job.poll() is None:
      time.sleep(0.5)
      with self.lock:
        if self.fault_at is not None:
          if time.monotonic() - self.fault_at > self.args.hang_s:
            self.hangs += 1
            os.killpg(job.pid, signal.SIGKILL)
          continue
        run = self.runs[-1]
        if run["cpus"] is None and run["saved"] is not None:  # the ranks' CPU binding
          run["cpus"] = sorted({c for c in map(cpus_allowed, training_pids(self.rig)) if c})
        if (len(self.faults) >= self.args.faults or run["saved"] is None
            or run["resumed"] is None or run["saved"] <= run["resumed"]):
          continue
        for _ in CYCLE:  # the next fault that applies to this world
          kind = CYCLE[kinds % len(CYCLE)]
          kinds += 1
          if self.inject(kind):
            break


def replay(args, chaos: "Chaos", finished: threading.Event, directory: str,
           codes: list[int]) -> None:
  """Runs the schedule's segments without faults as they become known (a thread)."""
  index = 0
  while True:
    done = finished.is_set()
    with chaos.lock:
      schedule = schedule_of(chaos.runs)
    ready = schedule if done else [s for s in schedule if s[2] is not None]
    if index >= len(ready):
      if done:
        return
      time.sleep(2.0)
      continue
    start, world, end = ready[index]
    argv = train_args(args, directory)
    if end is not None:
      argv += ["--max-steps", str(end)]
    env = test_launch.clean_env(1, JDIST_RESTART=str(index))
    # One core per rank, as the rig's mpirun binds the chaos job's (1 slot a node, not
    # oversubscribed); XLA's CPU results depend on the threads a process may use.
    ran = subprocess.run(test_launch.mpirun_argv(REPLAY_BINDING + argv, np=world), env=env,
                         cwd=jobs.REPO, capture_output=True, text=True, timeout=600, check=False)
    codes.append(ran.returncode)
    if ran.returncode:
      print(ran.stdout[-2000:] + ran.stderr[-2000:], file=sys.stderr)
      return
    resumed = resumed_step(ran.stdout)
    if resumed != start:  # the replay must start each segment where the chaos run did
      print(f"replay segment {index}: resumed from {resumed}, not {start}", file=sys.stderr)
      codes[-1] = -1
      return
    index += 1


def final_arrays(directory: str) -> dict:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
  return ocp.PyTreeCheckpointer().restore(os.path.join(directory, str(steps[-1]), "state"))


def schedule_of(runs: list[dict]) -> list[tuple[int, int, int | None]]:
  """(from step, processes, to step) per run that trained; the last to the end."""
  runs = [run for run in runs if run["resumed"] is not None]
  segments = []
  for run, following in zip(runs, runs[1:] + [None]):
    end = following["resumed"] if following else None
    if end is None or end > run["resumed"]:
      segments.append((run["resumed"], run["world"], end))
  return segments


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--faults", type=int, default=20)
  parser.add_argument("--epochs", type=int, default=40)
  parser.add_argument("--train-limit", type=int, default=512)
  parser.add_argument("--batch-size", type=int, default=16, help="per replica, 2 processes")
  parser.add_argument("--checkpoint-every", type=int, default=8)
  parser.add_argument("--local-every", type=int, default=4)
  parser.add_argument("--cooldown", type=float, default=10.0)
  parser.add_argument("--hang-s", type=float, default=120.0)
  parser.add_argument("--timeout", type=float, default=3000.0)
  parser.add_argument("--archive", default=None,
                      help="keep copies of every checkpoint of both runs here (default: "
                           "a temporary directory, deleted)")
  parser.add_argument("--tolerance", type=float, default=1e-5)
  parser.add_argument("--output", default=os.path.join(tempfile.gettempdir(),
                                                       "jdist_chaos_output.txt"),
                      help="the chaos job's output goes here")


def main(args: argparse.Namespace) -> int:
  started = time.monotonic()
  with tempfile.TemporaryDirectory() as tmp, cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
    chaos_dir, replay_dir = os.path.join(tmp, "chaos"), os.path.join(tmp, "replay")
    # Every checkpoint of both, as it appears: the runs keep only the newest few.
    archive = chaos_checkpoints.Archive(args.archive or os.path.join(tmp, "archive"), {
        "chaos": chaos_dir, "chaos_local": chaos_checkpoints.local_dirs(chaos_dir),
        "replay": replay_dir}).start()
    train = train_args(args, chaos_dir) + ["--local-checkpoint-every", str(args.local_every)]
    launch_args = ["--max-restarts", "30", "--cooldown", str(args.cooldown),
                   "--discovery-interval", "2"]
    job = rig_faults.launch(rig, train, 1, launch_args, test_launch.clean_env(1))
    chaos = Chaos(rig, args)
    reader = threading.Thread(target=chaos.read, args=(job.stdout,), daemon=True)
    reader.start()
    driver = threading.Thread(target=chaos.drive, args=(job,), daemon=True)
    driver.start()
    # The replay follows the schedule as it becomes known, beside the chaos run.
    finished, codes = threading.Event(), []
    replayer = threading.Thread(target=replay, args=(args, chaos, finished, replay_dir, codes),
                                daemon=True)
    replayer.start()
    try:
      job.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
      chaos.hangs += 1
      os.killpg(job.pid, signal.SIGKILL)
      job.wait()
    reader.join(timeout=5)
    chaos_s = time.monotonic() - started
    trained = [run for run in chaos.runs if run["resumed"] is not None]
    lost = sum(1 for before, after in zip(trained, trained[1:])
               if before["saved"] is not None and after["resumed"] < before["saved"])
    schedule = schedule_of(chaos.runs)
    with open(args.output, "w", encoding="utf-8") as handle:
      handle.writelines(chaos.lines)
    print(json.dumps({"event": "chaos", "code": job.returncode, "faults": len(chaos.faults),
                      "hangs": chaos.hangs, "runs": len(chaos.runs), "schedule": schedule,
                      "chaos_s": round(chaos_s, 1)}), flush=True)
    finished.set()
    replayer.join()
    archive.stop()
    for local in glob.glob(chaos_checkpoints.local_dirs(chaos_dir)):  # /dev/shm: memory
      shutil.rmtree(local, ignore_errors=True)
    steps = chaos_checkpoints.compare(archive.copies("chaos", "chaos_local"),
                                      archive.copies("replay"), schedule, args.tolerance)
    diff = None
    if len(codes) == len(schedule) and not any(codes):
      diff = chaos_checkpoints.difference(final_arrays(chaos_dir), final_arrays(replay_dir))[0]
    kinds = dict(collections.Counter(fault["kind"] for fault in chaos.faults))
    print(json.dumps({
        "event": "summary", "code": job.returncode, "faults": len(chaos.faults), "by_kind": kinds,
        "grow_backs": chaos.grows, "runs": len(chaos.runs), "hangs": chaos.hangs,
        "lost_checkpoints": lost, "corrupt_checkpoints": chaos.corrupt,
        "schedule": schedule, "replay_codes": codes, "max_param_diff": diff,
        "first_over_tolerance": steps["first_over"], "by_step": steps["steps"],
        "superseded_saves": steps["superseded"], "unreadable_copies": len(steps["unreadable"]),
        "runs_detail": chaos.runs,
        "chaos_s": round(chaos_s, 1), "total_s": round(time.monotonic() - started, 1),
        "restart_lines": [l.strip() for l in chaos.lines if "jdist launch: restart" in l]}),
        flush=True)
    if job.returncode != 0:
      print("".join(chaos.lines[-80:]), file=sys.stderr)
  return 0
