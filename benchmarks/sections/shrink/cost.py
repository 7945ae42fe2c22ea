"""ULFM's steady-state cost: the step loop under `mpirun --with-ft ulfm` and without, alternated.

Three configurations, in turn within each round (so that a change of the
shared machine's load hits all of them alike):

  * `ulfm`: what `jdist launch --shrink` runs (`launch_shrink.ULFM_MPIRUN_ARGS`:
    `--with-ft ulfm --mca btl tcp,self --mca coll ^han`);
  * `tcp`: plain mpirun with the same transport and collectives (the difference is ULFM);
  * `default`: plain mpirun with the usual transports (shared memory within a node).

Two placements: `shm` (2 processes on this host, plain `mpirun -np 2`) and
`rig` (1 process on each of the rig's 2 nodes, TCP over a 1 Gbit/s link).
The loop runs with one BLAS thread per process (`ONE_THREAD`): mpirun binds
each of 2 processes to a core, where a BLAS pool of 2 threads fights itself
(measured: the same product 16 to 250 ms between runs on a loaded machine).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Callable

from benchmarks.harness import cluster
from jdist.app import launch_shrink

CONFIGS = {
    "ulfm": list(launch_shrink.ULFM_MPIRUN_ARGS),
    "tcp": [a for a in launch_shrink.ULFM_MPIRUN_ARGS if a not in ("--with-ft", "ulfm")],
    "default": [],
}
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


LOOP_CODE = ("import sys; from benchmarks.sections.shrink import steploop; "
             "steploop.main(*map(int, sys.argv[1:]))")


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


def shm_starter(env: dict[str, str]) -> Callable[[list[str], list[str]], subprocess.Popen]:
  """Starts `command` as 2 processes on this host with mpirun flags `extra`."""
  env = dict(env, **ONE_THREAD)

  def start(command, extra):
    argv = [cluster.tool("mpirun"), "-np", "2", "--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
      argv.append("--allow-run-as-root")
    return subprocess.Popen(argv + list(extra) + command, env=env, cwd=_REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  return start


def rig_starter(rig: cluster.Cluster, env: dict[str, str]
                ) -> Callable[[list[str], list[str]], subprocess.Popen]:
  """Starts `command` as 1 process on each node of `rig` with mpirun flags `extra`."""
  env = dict(env, **ONE_THREAD)

  def start(command, extra):
    return rig.popen(command, 1, mpirun=cluster.tool("mpirun"), extra=extra, env=env,
                     cwd=_REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  return start


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
