"""ULFM's steady-state cost: the step loop (`steploop`) under `mpirun --with-ft ulfm` and without
(`tcp`, `default`), alternated within each round, on this host and across the rig.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import numpy as np

from benchmarks.harness import cluster
from benchmarks.harness import jobs
from jdist.app import launch_shrink

CONFIGS = {
    "ulfm": list(launch_shrink.ULFM_MPIRUN_ARGS),
    "tcp": [a for a in launch_shrink.ULFM_MPIRUN_ARGS if a not in ("--with-ft", "ulfm")],
    "default": [],
}
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LOOP_CODE = ("import sys; from benchmarks.sections.shrink import cost; "
             "cost.steploop(*map(int, sys.argv[1:]))")


def _loop_command(steps: int, warmup: int) -> list[str]:
  return [sys.executable, "-c", LOOP_CODE, str(steps), str(warmup)]


def _result(process: subprocess.Popen, timeout: float) -> dict:
  """The step loop's JSON line; raises RuntimeError with its output when there is none."""
  try:
    out, err = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    out, err = process.communicate()
  for line in out.splitlines():
    if line.startswith("{"):
      return json.loads(line)
  raise RuntimeError(f"the step loop printed no result (exit {process.returncode}):\n"
                     f"{(out + err)[-3000:]}")


Starter = Callable[[list[str], list[str]], subprocess.Popen]  # (command, mpirun flags) -> job


def shm_starter(env: dict[str, str]) -> Starter:
  """Starts a command as 2 processes on this host."""
  return lambda command, extra: subprocess.Popen(
      jobs.mpirun_argv(2) + list(extra) + command, env=dict(env, **ONE_THREAD), cwd=jobs.REPO,
      text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def rig_starter(rig: cluster.Cluster, env: dict[str, str]) -> Starter:
  """Starts a command as 1 process on each node of `rig`."""
  return lambda command, extra: rig.popen(
      command, 1, mpirun=cluster.tool("mpirun"), extra=extra, env=dict(env, **ONE_THREAD),
      cwd=jobs.REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def alternate(start, rounds: int, steps: int, warmup: int = 10,
              timeout: float = 300) -> list[dict]:
  """`rounds` rounds of every configuration in turn; one record per run."""
  records = []
  for round_index in range(rounds):
    order = list(CONFIGS) if round_index % 2 == 0 else list(reversed(CONFIGS))
    for name in order:
      result = _result(start(_loop_command(steps, warmup), CONFIGS[name]), timeout)
      result.update(config=name, round=round_index + 1, load=os.getloadavg()[0])
      print(f"  round {round_index + 1} {name}: step {result['step_s'] * 1e3:.1f} ms, "
            f"exchange {result['exchange_s'] * 1e3:.1f} ms (load {result['load']:.1f})",
            flush=True)
      records.append(result)
  return records


def ratios(records: list[dict], key: str = "step_s") -> dict[str, float]:
  """Median over rounds of `ulfm` / `tcp` and `ulfm` / `default` (per round, then median)."""
  by_round: dict[int, dict[str, float]] = {}
  for record in records:
    by_round.setdefault(record["round"], {})[record["config"]] = record[key]
  out = {}
  for other in ("tcp", "default"):
    per_round = [r["ulfm"] / r[other] for r in by_round.values() if "ulfm" in r and other in r]
    if per_round:
      out[f"ulfm/{other}"] = statistics.median(per_round)
  return out


GRADIENT_ELEMENTS = 131_080 + 3  # the digits CNN's parameters, then loss, correct, examples


def steploop(steps: int = 200, warmup: int = 20, compute: int = 192) -> int:
  """One rank of the loop: fixed host compute, then `jdist train --shrink`'s exchange (one
  `ShrinkableComm.sum` of the digits CNN's gradient, `confirm()` every `CONFIRM_EVERY` steps);
  rank 0 prints the mean step and exchange times as a JSON line.
  """
  from jdist.app import train_shrink  # pylint: disable=import-outside-toplevel
  from jdist.collectives import shrinkable  # pylint: disable=import-outside-toplevel
  comm = shrinkable.ShrinkableComm()
  rng = np.random.default_rng(comm.rank)
  matrix = rng.standard_normal((compute, compute)) if compute else None
  gradient = rng.standard_normal(GRADIENT_ELEMENTS)
  times, exchanges = [], []
  for step in range(warmup + steps):
    began = time.perf_counter()
    if matrix is not None:
      for _ in range(4):
        np.tanh(matrix @ matrix)  # the same work every step (the result is dropped)
    exchanged = time.perf_counter()
    comm.sum(gradient)
    if (step + 1) % train_shrink.CONFIRM_EVERY == 0:
      comm.confirm()  # as jdist train --shrink: the window's sums count once agreed
    ended = time.perf_counter()
    if step >= warmup:
      times.append(ended - began)
      exchanges.append(ended - exchanged)
  if comm.rank == 0:
    print(json.dumps({"processes": comm.size, "hosts": sorted(set(comm.hosts)),
                      "steps": steps, "step_s": statistics.fmean(times),
                      "exchange_s": statistics.fmean(exchanges)}), flush=True)
  return 0
