"""`jdist train` under `jdist launch` on the rig (`RigJob`) and the faults injected into it:
"kind:target", `kill_rank:R` (launch rank R), `kill_node:I`, `link_down:I` or `partition`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from typing import Callable, Sequence

from benchmarks.harness import cluster
from benchmarks.harness import jobs


def train_env(base: dict[str, str] | None = None) -> dict[str, str]:
  """`base` (default this process's) for `jdist train` on the rig: CPU, one device, unbuffered."""
  base = dict(os.environ if base is None else base)
  return dict(base, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
              PYTHONPATH=os.pathsep.join(filter(None, [jobs.REPO, base.get("PYTHONPATH")])),
              XLA_FLAGS="--xla_force_host_platform_device_count=1")


class RigJob:
  """`jdist launch FLAGS -- COMMAND` over `per_node` slots a node of `rig`, in its own session.

  `faults[i]` is injected `delay` s after the line of epoch `first + i` (their `time.time()`
  in `fault_times`); `on_line(line)` sees each line as it comes; `stamped` holds them with
  their `time.time()`.
  """

  def __init__(self, rig: cluster.Cluster, command: list[str], per_node: int,
               flags: list[str], env: dict[str, str], *, faults: Sequence[str] = (),
               first: int = 1, delay: float = 1.0,
               on_line: Callable[[str], None] | None = None):
    self.rig, self.faults, self.first, self.delay, self.on_line = rig, faults, first, delay, on_line
    self.proc = subprocess.Popen(rig.launch_argv(command, per_node, flags),
                                 env=rig.launch_env(env), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, cwd=jobs.REPO,
                                 start_new_session=True)
    self.stamped: list[tuple[float, str]] = []
    self.fault_times: list[float] = []
    self._started: set[int] = set()

  def _read(self) -> None:
    for line in self.proc.stdout:
      self.stamped.append((time.time(), line))
      epoch = line.startswith("epoch ") and line.split()[1].split("/")[0]
      index = int(epoch) - self.first if epoch and epoch.isdigit() else -1
      if 0 <= index < len(self.faults) and index not in self._started:
        self._started.add(index)
        threading.Timer(self.delay, self._inject, (self.faults[index],)).start()
      if self.on_line is not None:
        self.on_line(line)

  def _inject(self, fault: str) -> None:
    # Each timer gets its own fault: a lambda over the loop's variable would
    # inject whichever fault a later epoch's line had set by then.
    self.fault_times.append(inject(self.rig, fault))

  def follow(self, timeout: float) -> float:
    """Waits for the job to end (`jobs.follow`: killed, raising, past `timeout`); its end."""
    return jobs.follow(self.proc, self._read, timeout)

  @property
  def code(self) -> int | None:
    return self.proc.returncode

  @property
  def lines(self) -> list[str]:
    return [line for _, line in self.stamped]

  @property
  def text(self) -> str:
    return "".join(self.lines)

  def first_line(self, start: str, after: float | None) -> float | None:
    """When the first line starting with `start` came at or after `after` (None: no such line)."""
    if after is None:
      return None
    return next((at for at, line in self.stamped if at >= after and line.startswith(start)), None)


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


def inject(rig: cluster.Cluster, fault: str) -> float:
  """Injects `fault` ("kind:target", see the module docstring); returns its `time.time()`."""
  kind, _, target = fault.partition(":")
  if kind == "kill_rank":
    marker = f"OMPI_COMM_WORLD_RANK={target}".encode()
    pids = pids_where(rig, lambda words: marker in words, "environ")
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
