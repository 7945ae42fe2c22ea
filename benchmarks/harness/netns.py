"""Emulated cluster links on one machine: a private network namespace, its loopback shaped by `tc`
(`tbf`, delays `netem`); needs root and iproute2 (`missing_requirements`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from typing import Iterable, Iterator

from benchmarks.harness import jobs

PREFIX = "jdist-net-"
# Open MPI over TCP on the namespace's loopback (it skips loopback unless told).
MPI_TCP_ARGS = ("--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", "lo")
_COUNTER = itertools.count()


class NamespaceError(RuntimeError):
  """A namespace or qdisc could not be created (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Link:
  """A shaped link: its label, rate (None: shared memory) and one-way delay."""
  name: str
  rate_mbit: float | None
  delay_ms: float = 0.0

  @property
  def shaped(self) -> bool:
    return self.rate_mbit is not None


LINKS = (Link("shm", None), Link("10gbit", 10_000), Link("1gbit", 1_000), Link("100mbit", 100),
         Link("100mbit+1ms", 100, delay_ms=1.0), Link("10mbit", 10))


def link_named(name: str) -> Link:
  for link in LINKS:
    if link.name == name:
      return link
  raise ValueError(f"Unknown link {name!r}; choose from {[l.name for l in LINKS]}.")


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
  result = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
  if check and result.returncode != 0:
    raise NamespaceError(f"`{' '.join(argv)}` failed ({result.returncode}): "
                         f"{(result.stderr or result.stdout).strip()}")
  return result


def missing_tools(tools: Iterable[str], what: str) -> list[str]:
  """Why `what` cannot run here (not root, or one of `tools` missing), a sentence each."""
  missing = []
  if hasattr(os, "geteuid") and os.geteuid() != 0:
    missing.append(f"not root: {what} need root (or CAP_NET_ADMIN and CAP_SYS_ADMIN)")
  for tool in tools:
    if shutil.which(tool) is None:
      package = "util-linux" if tool == "unshare" else "iproute2"
      missing.append(f"`{tool}` not found: install {package} (apt-get install -y {package})")
  return missing


def missing_requirements() -> list[str]:
  """What stops this machine from making shaped namespaces, a sentence each (empty: nothing)."""
  missing = missing_tools(("ip", "tc"), "network namespaces and tc")
  if missing:
    return missing
  try:
    with shaped_namespace(Link("probe", 1000)):
      pass
  except (NamespaceError, OSError, subprocess.TimeoutExpired) as err:
    missing.append(f"cannot create a shaped network namespace here: {err}")
  return missing


def netem_available() -> bool:
  """Whether the kernel has the netem qdisc (needed for a delay)."""
  try:
    with shaped_namespace(Link("probe", 1000, delay_ms=1.0)):
      return True
  except NamespaceError:
    return False


def exec_prefix(name: str) -> list[str]:
  """The argv prefix that runs a command inside namespace `name`."""
  return ["ip", "netns", "exec", name]


def tbf_args(rate_mbit: float) -> list[str]:
  """A token bucket of `rate_mbit`; the burst covers 1 ms at that rate (256 KB at least)."""
  burst = max(256 * 1024, int(rate_mbit * 1e6 / 8 / 1000))
  return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "100ms"]


def shape(name: str, link: Link) -> None:
  """Puts `link`'s qdiscs on namespace `name`'s loopback: `tbf`, under `netem` with a delay."""
  tc = exec_prefix(name) + ["tc", "qdisc"]
  if not link.delay_ms:
    _run(tc + ["replace", "dev", "lo", "root"] + tbf_args(link.rate_mbit))
    return
  try:
    _run(tc + ["replace", "dev", "lo", "root", "handle", "1:", "netem", "delay",
               f"{link.delay_ms:g}ms", "limit", "100000"])
  except NamespaceError as err:
    raise NamespaceError(f"{err} (the kernel has no netem qdisc, `sch_netem`: links "
                         f"with a delay cannot be emulated on this machine)") from None
  _run(tc + ["add", "dev", "lo", "parent", "1:", "handle", "2:"] + tbf_args(link.rate_mbit))


def namespace_pids(name: str) -> list[int]:
  result = _run(["ip", "netns", "pids", name], check=False)
  return [int(pid) for pid in result.stdout.split() if pid.isdigit()]


def delete(name: str) -> None:
  """Kills what still runs in namespace `name`, then deletes it (and its qdiscs)."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    pids = namespace_pids(name)
    for pid in pids:
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)
    deadline = time.monotonic() + 3
    while pids and namespace_pids(name) and time.monotonic() < deadline:
      time.sleep(0.05)
  _run(["ip", "netns", "delete", name], check=False)


def exists(name: str) -> bool:
  return name in list_names()


def list_names() -> list[str]:
  """Names of every network namespace `ip` knows."""
  result = _run(["ip", "netns", "list"], check=False)
  return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def remove_stale() -> list[str]:
  """Deletes this module's namespaces whose creating process is gone; returns them."""
  removed = []
  for name in list_names():
    match = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", name)
    if match and not os.path.exists(f"/proc/{match.group(1)}"):
      delete(name)
      removed.append(name)
  return removed


@contextlib.contextmanager
def shaped_namespace(link: Link) -> Iterator[str]:
  """A fresh namespace with its loopback up and shaped as `link`; yields its name."""
  if not link.shaped:
    raise ValueError(f"Link {link.name!r} has no rate: run it without a namespace.")
  with private_namespace() as name:
    shape(name, link)
    yield name


@contextlib.contextmanager
def private_namespace() -> Iterator[str]:
  """A fresh namespace with its loopback up, unshaped; yields its name."""
  name = f"{PREFIX}{os.getpid()}-{next(_COUNTER)}"
  _run(["ip", "netns", "add", name])
  try:
    _run(exec_prefix(name) + ["ip", "link", "set", "lo", "up"])
    yield name
  finally:
    delete(name)


def terminate_on_sigterm() -> None:
  """Turns SIGTERM into SystemExit, so `finally` blocks (namespace deletion) run."""
  def handler(signum, frame):
    del frame
    raise SystemExit(128 + signum)
  signal.signal(signal.SIGTERM, handler)


def link_namespace(link: Link):
  """A context yielding `link`'s fresh shaped namespace, or None for shared memory."""
  return shaped_namespace(link) if link.shaped else contextlib.nullcontext()


def in_namespace(job: jobs.Job, name: str | None) -> jobs.Job:
  """`job` run inside namespace `name` with MPI over its loopback (None: as it is)."""
  if name is None:
    return job
  return dataclasses.replace(job, prefix=tuple(exec_prefix(name)), mpirun_args=MPI_TCP_ARGS)


def available_links(links) -> tuple[list[Link], list[str]]:
  """The links of `links` this machine can emulate, and why not the others."""
  chosen, skipped = list(links), []
  missing = missing_requirements() if any(l.shaped for l in chosen) else []
  if missing:
    skipped.append("shaped links skipped: " + "; ".join(missing))
    chosen = [l for l in chosen if not l.shaped]
  if any(l.delay_ms for l in chosen) and not netem_available():
    skipped.append("links with a delay skipped: this kernel has no netem qdisc (sch_netem); "
                   "tc cannot add latency here")
    chosen = [l for l in chosen if not l.delay_ms]
  return chosen, skipped


def gloo_env() -> tuple[tuple[str, str], ...]:
  """A job's environment for torch.distributed's gloo rendezvous on a free loopback port."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  return (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("GLOO_SOCKET_IFNAME", "lo"))
