"""`jdist train` under `jdist launch` on the rig, and the faults injected into it.

Shared by the `faults`, `elastic_restart` and `shrink` sections.
A fault is "kind:target": `kill_rank:R` (launch rank R's processes),
`kill_node:I`, `link_down:I` (node I) or `partition` (every node on its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from typing import Callable

from benchmarks.harness import cluster
from benchmarks.harness import jobs


def train_env(base: dict[str, str] | None = None) -> dict[str, str]:
  """`base` (default this process's) for `jdist train` on the rig: CPU, one device, unbuffered."""
  base = dict(os.environ if base is None else base)
  return dict(base, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
              PYTHONPATH=os.pathsep.join(filter(None, [jobs.REPO, base.get("PYTHONPATH")])),
              XLA_FLAGS="--xla_force_host_platform_device_count=1")


def launch(rig: cluster.Cluster, command: list[str], per_node: int, launch_args: list[str],
           env: dict[str, str]) -> subprocess.Popen:
  """`jdist launch LAUNCH_ARGS -- COMMAND` over `per_node` slots a node, in a session of its own."""
  return subprocess.Popen(rig.launch_argv(command, per_node, launch_args),
                          env=rig.launch_env(env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=jobs.REPO,
                          start_new_session=True)


class Output:
  """A job's output lines as they come (`stamped`: with their `time.time()`).

  Args:
    job: a `launch`ed job.
    on_line: called with each line as it comes (in the reading thread).
  """

  def __init__(self, job: subprocess.Popen, on_line: Callable[[str], None] | None = None):
    self.job, self.on_line = job, on_line
    self.lines: list[str] = []
    self.stamped: list[tuple[float, str]] = []

  def _read(self) -> None:
    for line in self.job.stdout:
      self.lines.append(line)
      self.stamped.append((time.time(), line))
      if self.on_line is not None:
        self.on_line(line)

  def follow(self, timeout: float) -> float:
    """Waits for the job to end (`jobs.follow`: killed, raising, past `timeout`); its end."""
    return jobs.follow(self.job, self._read, timeout)

  @property
  def text(self) -> str:
    return "".join(self.lines)


def pids_where(rig: cluster.Cluster, test: Callable[[list[bytes]], bool],
               what: str = "cmdline") -> list[int]:
  """The rig's processes whose `/proc/PID/<what>` (split at NULs) passes `test`."""
  found = []
  for pid in rig.namespace_pids():
    with contextlib.suppress(OSError):
      with open(f"/proc/{pid}/{what}", "rb") as handle:
        if test(handle.read().split(b"\0")):
          found.append(pid)
  return found


def rank_pids(rig: cluster.Cluster, rank: int) -> list[int]:
  """The processes of launch rank `rank` (its OMPI_COMM_WORLD_RANK) on any node."""
  marker = f"OMPI_COMM_WORLD_RANK={rank}".encode()
  return pids_where(rig, lambda words: marker in words, "environ")


def inject(rig: cluster.Cluster, fault: str) -> float:
  """Injects `fault` ("kind:target", see the module docstring); returns its `time.time()`."""
  kind, _, target = fault.partition(":")
  if kind == "kill_rank":
    pids = rank_pids(rig, int(target))
    if not pids:
      raise RuntimeError(f"no process of rank {target} on the rig")
    at = time.time()
    for pid in pids:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return at
  if kind not in ("kill_node", "link_down", "partition"):
    raise ValueError(f"unknown fault {fault!r}: kill_rank:R, kill_node:I, link_down:I or "
                     "partition")
  at = time.time()
  if kind == "partition":
    rig.partition()
  else:
    getattr(rig, kind)(int(target))
  return at


def read_jsonl(path: str) -> list[dict]:
  """The records of a JSON-lines log ([] when it is missing)."""
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as handle:
    return [json.loads(line) for line in handle if line.strip()]
