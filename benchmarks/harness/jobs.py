"""Benchmark jobs: one topology (processes x local devices) and its measurements, run as
`python -m benchmarks worker` ranks (under mpirun for P > 1) with a hard timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Job:
  name: str
  processes: int
  devices: int
  sections: tuple[types.ModuleType, ...]  # measurement modules: `NAME` and `run(ctx)` each
  backend: str | None = None
  env: tuple[tuple[str, str], ...] = ()
  options: tuple[tuple[str, Any], ...] = ()  # handed to the sections (ctx.options)
  program: str = "worker"  # the per-rank program (`python -m benchmarks PROGRAM --out --config`)
  prefix: tuple[str, ...] = ()  # argv before the launcher (e.g. `ip netns exec NAME`)
  mpirun_args: tuple[str, ...] = ()  # extra mpirun options (e.g. MCA parameters)


def binary(name: str) -> str:
  """The console script `name` beside this interpreter, else on PATH (mpirun, torchrun)."""
  here = os.path.join(os.path.dirname(sys.executable), name)
  return here if os.path.exists(here) else (shutil.which(name) or name)


def mpirun_argv(processes: int) -> list[str]:
  """`mpirun -np PROCESSES --oversubscribe` on this host (`--allow-run-as-root` as root)."""
  argv = [binary("mpirun"), "-np", str(processes), "--oversubscribe"]
  return argv + (["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])


def program_argv(job: Job, out_prefix: str, quick: bool) -> list[str]:
  """The argv of one of `job`'s ranks: `python -m benchmarks PROGRAM --out --config`."""
  config = json.dumps({"job": job.name, "sections": [m.__name__ for m in job.sections],
                       "quick": quick, "backend": job.backend, "options": dict(job.options)})
  return [sys.executable, "-m", "benchmarks", job.program, "--out", out_prefix,
          "--config", config]


def command(job: Job, out_prefix: str, quick: bool) -> list[str]:
  """The argv that starts `job`'s processes."""
  worker = program_argv(job, out_prefix, quick)
  if job.processes == 1:
    return list(job.prefix) + worker
  return list(job.prefix) + mpirun_argv(job.processes) + list(job.mpirun_args) + worker


def environment(job: Job) -> dict[str, str]:
  """The parent's environment without MPI rank variables, plus the job's devices."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PMI_"))}
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={job.devices}"])
  env.setdefault("JAX_PLATFORMS", "cpu")
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  env["PYTHONUNBUFFERED"] = "1"
  env.setdefault("JDIST_TIMEOUT", "60")  # a rank stalled this long ends the job, diagnosed
  # The hand-written baselines are per-process `jax.pmap`s: with JAX's distributed runtime
  # on, a pmap spans every process's devices (jdist's own exchanges are the same either way).
  env.setdefault("JDIST_JAX_DISTRIBUTED", "0")
  env.update(dict(job.env))
  return env


def merge_ranks(results: list[dict]) -> dict[str, Any]:
  """One job result from every rank's: durations their maximum, all else rank 0's."""
  first = results[0]
  merged = {k: first[k] for k in ("job", "topology", "backend", "init_error")}
  merged["sections"] = {}
  for name in first["sections"]:
    sections = [r["sections"].get(name, {"rows": [], "complete": False}) for r in results]
    rows = []
    for per_rank in zip(*(s["rows"] for s in sections)):
      rows.append({k: max(r[k] for r in per_rank) if k.endswith("_s") and isinstance(
          v, (int, float)) else v for k, v in per_rank[0].items()})
    section = {"rows": rows, "complete": all(s["complete"] for s in sections),
               "wall_s": max(s.get("wall_s", 0.0) for s in sections)}
    errors = [s["error"] for s in sections if "error" in s]
    if errors:
      section["error"] = errors[0]
    merged["sections"][name] = section
  return merged


def _tail(output) -> str:
  if isinstance(output, bytes):
    output = output.decode(errors="replace")
  return (output or "")[-3000:]


def launch(argvs: list[list[str]], env: dict[str, str], timeout: float) -> str | None:
  """Runs every argv at once, each in its own process group; None if all succeeded, else why
  not. Past `timeout` every group (mpirun and the ranks it started) is killed.
  """
  procs = [subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True) for argv in argvs]
  deadline = time.monotonic() + timeout
  try:
    for proc in procs:
      output = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
      if proc.returncode != 0:
        return f"exit status {proc.returncode}:\n{_tail(output)}"
    return None
  except subprocess.TimeoutExpired:
    output = b""
    for sig in (signal.SIGTERM, signal.SIGKILL):
      _signal(procs, sig)
      with contextlib.suppress(subprocess.TimeoutExpired):
        output = b"".join(p.communicate(timeout=5)[0] or b"" for p in procs if p.returncode is None)
        break
    return f"timed out after {timeout:.0f} s:\n{_tail(output)}"
  finally:
    _signal(procs, signal.SIGKILL)  # what outlived its launcher (a node's torchrun)


def _signal(procs: list[subprocess.Popen], sig: int) -> None:
  for proc in procs:
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(proc.pid, sig)


def collect(job: Job, start_job: Callable[[str], str | None]) -> dict[str, Any]:
  """`job` started by `start_job(out_prefix)`, its ranks' results merged."""
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix=f"jdist-bench-{job.name}-") as tmp:
    prefix = os.path.join(tmp, "result")
    failure = start_job(prefix)
    ranks = []
    for path in sorted(glob.glob(prefix + ".rank*.json")):
      with open(path, encoding="utf-8") as f:
        ranks.append(json.load(f))
  result = merge_ranks(ranks) if len(ranks) == job.processes else {"job": job.name, "sections": {}}
  result["job"] = job.name
  if failure is not None:
    result["error"] = failure
  elif len(ranks) != job.processes:
    result["error"] = f"{len(ranks)} of {job.processes} ranks wrote results"
  result["wall_s"] = time.perf_counter() - start
  return result


def run(job: Job, *, quick: bool, timeout: float, log=print) -> dict[str, Any]:
  """Runs `job` to completion (or its timeout); its merged result (`collect`)."""
  log(f"[{job.name}] {' '.join(m.NAME for m in job.sections)} ...")
  result = collect(job, lambda prefix: launch([command(job, prefix, quick)], environment(job),
                                              timeout))
  log(f"[{job.name}] done in {result['wall_s']:.1f} s"
      + (f": FAILED {result['error'][:300]}" if "error" in result else ""))
  return result


def follow(job: subprocess.Popen, read: Callable[[], None], timeout: float) -> float:
  """Waits for `job` (its own session) while `read` consumes its output in a thread; returns
  when it ended (`time.time()`). Past `timeout` its group is killed and TimeoutExpired raised.
  """
  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    job.wait(timeout=timeout)
  finally:
    if job.poll() is None:
      os.killpg(job.pid, signal.SIGKILL)
      job.wait()
  ended = time.time()
  reader.join(timeout=5)  # a lost node's daemons can hold the pipe open
  return ended
