"""What `jdist train --local-checkpoint-every K` costs per step: local tier on vs off.

    bash scripts/mpirun.sh -np 2 .venv/bin/python -m benchmarks local_commit \
        --every 50 --rounds 4 --epochs 10 --cpu-devices 1

Runs the SINGA CNN (`jdist train --model cnn`) on sklearn's digits in the
processes mpirun starts (2 x 1 above: --cpu-devices is each process's
CPU device count), `2 x rounds` times in one job, alternating
the local tier off and on (off, on, on, off, ...: drift over the job falls
on both alike). Both have the persistent tier at epoch ends; an epoch's
train time excludes that save and the evaluation but includes every local
save made in it. Prints one JSON line per run and a summary: the median
per-step time of each mode, their ratio (target: on / off <= 1.03 at
K = 50), and the local saves made. On a loaded machine the runs' times
vary more than 3%, so the on-runs also time each local save itself
(`Run.save(local=True)`, wrapped here): its wall time, pipeline drain and
NaN check included, and its share of those runs' train time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import jdist
import jdist.app.cpu_devices
from jdist.app.config import TrainConfig
from jdist.app import train_loop
from jdist.app.train import train
from jdist.runtime import host


SAVE_TIMES: list[float] = []


def _timed_save(original):
  def save(self, *args, local=False, **kwargs):
    start = time.perf_counter()
    result = original(self, *args, local=local, **kwargs)
    if local:
      SAVE_TIMES.append(time.perf_counter() - start)
    return result
  return save


def one_run(every: int, epochs: int, batch: int, local: bool, devices: int) -> dict:
  """Trains once; returns the steps, the train time summed over epochs and the local saves."""
  shared = tempfile.mkdtemp(prefix="jdist_local_bench_") if jdist.init().is_primary else None
  shared = host.allgather_object(shared)[0]
  local_dir = os.path.join(shared, "local")
  config = TrainConfig(model="cnn", dataset="digits", epochs=epochs, batch_size=batch,
                       seed=0, progress=False, cpu_devices=devices, eval_every=0, check_replicas_every=0,
                       checkpoint_dir=os.path.join(shared, "ckpt"),
                       local_checkpoint_every=every if local else 0,
                       local_checkpoint_dir=local_dir if local else None)
  first = len(SAVE_TIMES)
  try:
    summary = train(config)
  finally:
    host.barrier()
    if jdist.init().is_primary:
      shutil.rmtree(shared, ignore_errors=True)
  epochs_ = summary["epochs"][1:]  # the first holds the compilation
  steps = sum(e["train_examples"] for e in epochs_) / (batch * summary["topology"]["replicas"])
  seconds = sum(e["train_time_s"] for e in epochs_)
  saves = summary["steps"] // every - sum(
      1 for e in summary["epochs"] if e["step"] % every == 0) if local else 0
  timed = SAVE_TIMES[first:]
  return {"local": local, "steps": round(steps), "train_s": seconds,
          "ms_per_step": 1e3 * seconds / steps, "local_saves": saves,
          "local_save_ms": [round(1e3 * t, 2) for t in timed],
          "local_save_share": sum(timed) / seconds}  # none in the first epoch (K > its steps)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--every", type=int, default=50, help="local save every K steps")
  parser.add_argument("--rounds", type=int, default=4, help="pairs of runs (off + on)")
  parser.add_argument("--epochs", type=int, default=10, help="epochs per run")
  parser.add_argument("--batch-size", type=int, default=32, help="per replica")
  parser.add_argument("--cpu-devices", type=int, default=1, help="CPU devices per process")


def main(args: argparse.Namespace) -> int:
  jdist.app.cpu_devices.force_cpu_devices(args.cpu_devices)
  train_loop.Run.save = _timed_save(train_loop.Run.save)
  topo = jdist.init()
  runs = []
  for round_ in range(args.rounds):
    for local in ((False, True) if round_ % 2 == 0 else (True, False)):
      result = one_run(args.every, args.epochs, args.batch_size, local, args.cpu_devices)
      runs.append(result)
      if topo.is_primary:
        print(json.dumps(result), flush=True)
  if topo.is_primary:
    off = [r["ms_per_step"] for r in runs if not r["local"]]
    on = [r["ms_per_step"] for r in runs if r["local"]]
    print(json.dumps({
        "event": "summary", "processes": topo.process_count,
        "devices_per_process": topo.local_device_count, "every": args.every,
        "ms_per_step_off": statistics.median(off), "ms_per_step_on": statistics.median(on),
        "ratio_on_off": statistics.median(on) / statistics.median(off),
        "target_ratio": 1.03, "local_saves_per_run": runs[1]["local_saves"],
        "local_save_ms_median": statistics.median(
            t for r in runs if r["local"] for t in r["local_save_ms"]),
        "local_save_share_median": statistics.median(
            r["local_save_share"] for r in runs if r["local"])}), flush=True)
