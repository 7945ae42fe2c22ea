"""Elastic restarts for `jdist launch`: the healthy hosts, the next -np, the restart's batch.

`jdist launch --max-restarts N` runs the job again when it fails. This module
holds what decides the next run, apart from mpirun itself:

  * `read_hostfile` / `write_hostfile`: the `HOST slots=N` lines;
  * `Blacklist`: hosts that were lost, each left out until its cooldown ends
    (then it is tried again at the next restart);
  * `lost_entries`: which hostfile lines the lost hosts are. The job names a
    host by what it calls itself (`nodeB`), the hostfile may name it by an
    address (`10.0.0.2`); the rank -> host map and the by-slot placement of
    ranks over the hostfile connect the two;
  * `processes_for`: -np over the healthy hosts (every slot, or the user's
    processes per node when -np was fixed);
  * `restart_batch_size`: the hook `jdist train` uses on a restarted run so
    that a checkpoint written by R replicas x batch B continues exactly on
    R' replicas (batch B x R / R': the same global batch);
  * `parse_discovery` / `discover`: `--host-discovery SCRIPT`'s hosts
    (Horovod style: `HOST`, `HOST:SLOTS` or `HOST slots=N` lines), read at
    each (re)start and every `--discovery-interval` seconds;
  * `grow_to`: whether a running job on fewer hosts than are available
    should be stopped at its next checkpoint and restarted over more.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
import time
from typing import Callable, Sequence

RESTART_ENV = "JDIST_RESTART"  # the restart's number (0: the first run), in every rank
DEFAULT_COOLDOWN_S = 600.0
DEFAULT_DISCOVERY_INTERVAL_S = 30.0  # seconds between runs of --host-discovery
DEFAULT_PROBE_TIMEOUT_S = 5.0  # seconds a returning host has to answer the launch agent


# JAX's persistent compilation cache, for every run of a restarted job: a
# restart then loads the steps it compiled before instead of compiling them
# again (on the rig, the first step after a restart took 3.4 s without it).
COMPILE_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def compile_cache_env(environ: dict[str, str]) -> dict[str, str]:
  """The compilation cache's settings for a restarted job's ranks.

  A cache directory the user set is kept (and forwarded to every node);
  otherwise one per user in each node's temporary directory, reused across
  runs and launches, where every compiled program is kept (JAX keeps only
  those that took over 1 s by default). It is not size-capped: JAX's cap
  needs the `filelock` package, which jdist does not install.
  """
  if environ.get(COMPILE_CACHE_ENV):
    return {COMPILE_CACHE_ENV: environ[COMPILE_CACHE_ENV]}
  directory = os.path.join(tempfile.gettempdir(), f"jdist-xla-cache-{os.getuid()}")
  return {COMPILE_CACHE_ENV: directory, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


class ElasticError(RuntimeError):
  """The job cannot go on (the message says why, in one line)."""


@dataclasses.dataclass(frozen=True)
class Host:
  """One hostfile line: a host and its process slots."""
  name: str
  slots: int = 1


def read_hostfile(path: str) -> list[Host]:
  """The hosts of an Open MPI hostfile (`HOST [slots=N] [max_slots=M]`, # comments).

  A line without `slots=` counts as one slot (Open MPI would count the
  host's cores, which a launcher on another machine cannot know).
  """
  hosts = []
  with open(path, encoding="utf-8") as handle:
    for number, line in enumerate(handle, 1):
      words = line.split("#", 1)[0].split()
      if not words:
        continue
      slots = 1
      for word in words[1:]:
        match = re.fullmatch(r"slots=(\d+)", word)
        if match:
          slots = int(match.group(1))
        elif not re.fullmatch(r"max[-_]slots=\d+", word):
          raise ElasticError(f"{path} line {number}: cannot read {word!r} (expected "
                             f"`HOST slots=N`)")
      if slots < 1:
        raise ElasticError(f"{path} line {number}: slots={slots} must be at least 1")
      if any(host.name == words[0] for host in hosts):
        raise ElasticError(f"{path} line {number}: host {words[0]} is listed twice")
      hosts.append(Host(words[0], slots))
  if not hosts:
    raise ElasticError(f"{path} names no host")
  return hosts


def write_hostfile(hosts: Sequence[Host], path: str) -> str:
  with open(path, "w", encoding="utf-8") as handle:
    for host in hosts:
      handle.write(f"{host.name} slots={host.slots}\n")
  return path


class Blacklist:
  """Lost hosts, each left out for `cooldown` seconds after it was lost.

  Args:
    cooldown: seconds a lost host stays out; once over, the host is tried
      again at the next restart (and blacklisted again if it fails again).
    clock: seconds, monotonic (tests pass their own).
  """

  def __init__(self, cooldown: float = DEFAULT_COOLDOWN_S,
               clock: Callable[[], float] = time.monotonic):
    self.cooldown, self._clock, self._since = cooldown, clock, {}

  def add(self, name: str) -> None:
    self._since[name] = self._clock()

  def blocked(self) -> list[str]:
    """Hosts still in their cooldown."""
    now = self._clock()
    return [name for name, since in self._since.items() if now - since < self.cooldown]

  def healthy(self, hosts: Sequence[Host]) -> list[Host]:
    """`hosts` without those in their cooldown, in hostfile order."""
    blocked = set(self.blocked())
    return [host for host in hosts if host.name not in blocked]

  def lost_before(self, name: str) -> bool:
    """Whether `name` was lost once (in its cooldown or past it)."""
    return name in self._since


def placement(hosts: Sequence[Host], processes: int) -> list[str]:
  """The host of each rank under Open MPI's default by-slot mapping (`--map-by slot`)."""
  ranks = [host.name for host in hosts for _ in range(host.slots)]
  if processes > len(ranks):
    raise ElasticError(f"{processes} processes do not fit the {len(ranks)} slots of "
                       f"{', '.join(h.name for h in hosts)}")
  return ranks[:processes]


def lost_entries(lost: Sequence[str], rank_hosts: dict[int, str], hosts: Sequence[Host],
                 processes: int, silent: dict[str, list[int]] | None = None) -> list[str]:
  """The hostfile lines (names) of the hosts a failed run lost.

  Args:
    lost: the hosts the run's output named (PRRTE's or jdist's watchdog's words).
    rank_hosts: rank -> the host name it reported (`[jdist-launch] hosts`).
    hosts: the hostfile the run used.
    processes: its -np.
    silent: host -> ranks that jdist's watchdog found silent.

  Raises:
    ElasticError: a lost host matches no hostfile line.
  """
  placed = placement(hosts, processes)
  names = {host.name for host in hosts}
  found = []
  for name in lost:
    if name in names:
      entries = {name}
    else:  # the host's own name: its ranks' hostfile line under by-slot mapping
      ranks = [r for r, h in rank_hosts.items() if h == name] or (silent or {}).get(name, [])
      entries = {placed[r] for r in ranks if r < len(placed)}
    if len(entries) != 1:
      raise ElasticError(
          f"cannot tell which hostfile line is the lost host {name} (hostfile: "
          f"{', '.join(sorted(names))}); list hosts by the names they call themselves, or "
          f"keep Open MPI's default by-slot mapping")
    found += [entry for entry in entries if entry not in found]
  return found


def parse_discovery(text: str, source: str = "host discovery") -> list[Host]:
  """The hosts a `--host-discovery` script printed, one a line.

  Each line is `HOST`, `HOST:SLOTS` or `HOST slots=N` (Horovod's forms and
  the hostfile's); blank lines and `#` comments are skipped. The output may
  name no host (none available now).

  Raises:
    ElasticError: a line that is none of those forms, a slot count below 1,
      or a host listed twice (naming the line).
  """
  hosts: list[Host] = []
  for number, line in enumerate(text.splitlines(), 1):
    words = line.split("#", 1)[0].split()
    if not words:
      continue
    match = re.fullmatch(r"([^:\s]+)(?::(\d+))?", words[0])
    slots = int(match.group(2)) if match and match.group(2) else 1
    extra = re.fullmatch(r"slots=(\d+)", words[1]) if len(words) == 2 else None
    if not match or len(words) > 2 or (len(words) == 2 and (not extra or match.group(2))):
      raise ElasticError(f"{source} line {number}: cannot read {line.strip()!r} (expected "
                         f"`HOST`, `HOST:SLOTS` or `HOST slots=N`)")
    if extra:
      slots = int(extra.group(1))
    if slots < 1:
      raise ElasticError(f"{source} line {number}: {slots} slots; a host needs at least 1")
    if any(host.name == match.group(1) for host in hosts):
      raise ElasticError(f"{source} line {number}: host {match.group(1)} is listed twice")
    hosts.append(Host(match.group(1), slots))
  return hosts


def discover(script: str, timeout: float = 30.0) -> list[Host]:
  """Runs a `--host-discovery` script; returns the hosts it printed.

  Raises:
    ElasticError: the script cannot be run, fails, or runs past `timeout`.
  """
  try:
    done = subprocess.run([script], capture_output=True, text=True, timeout=timeout,
                          check=False)
  except (OSError, subprocess.TimeoutExpired) as err:
    raise ElasticError(f"host discovery {script} could not run ({type(err).__name__}: "
                       f"{err}); it must be an executable file") from None
  if done.returncode:
    raise ElasticError(f"host discovery {script} failed with exit status {done.returncode}: "
                       f"{done.stderr.strip()[-300:] or 'no message'}")
  return parse_discovery(done.stdout, f"host discovery {script}")


def grow_to(running: Sequence[Host], processes: int, available: Sequence[Host],
            fixed: int | None, per_node: int | None) -> tuple[list[Host], int] | None:
  """Where a running job should continue when more hosts are available, or None.

  Args:
    running: the hosts the job runs on.
    processes: its -np.
    available: the hosts it could run on now (discovered, or the hostfile's
      past their cooldown that answer a probe), in order.
    fixed, per_node: as for `processes_for`.

  Returns:
    (hosts, processes) of the larger run, or None when it would not have
    more processes (nothing new, or a fixed -np already reached).
  """
  if not {h.name for h in available} - {h.name for h in running}:
    return None
  more = processes_for(available, fixed, per_node)
  return (list(available), more) if more > processes else None


def used_hosts(hosts: Sequence[Host], processes: int) -> int:
  """How many hostfile lines a by-slot placement of `processes` ranks touches."""
  return len(set(placement(hosts, processes)))


def processes_for(healthy: Sequence[Host], fixed: int | None, per_node: int | None) -> int:
  """-np for the next run over `healthy` hosts.

  Without a fixed -np every healthy slot gets a process. With one, the job
  keeps its processes per node (`per_node`, from the first run) on as many
  healthy nodes as it first ran on: never more than the fixed -np, never
  more than the healthy slots.
  """
  slots = sum(host.slots for host in healthy)
  if fixed is None:
    return slots
  return min(fixed, slots, sum(min(per_node, host.slots) for host in healthy))


def restart_batch_size(checkpoint_dir: str | None, replica_count: int,
                       batch_size: int) -> tuple[int, str | None]:
  """The per-replica batch a restarted `jdist train` uses (the hook on the train side).

  Under `jdist launch` (JDIST_RESTART >= 1) the command is the first run's,
  and so is its `--batch-size`, but the replicas are fewer (or more). When
  the newest checkpoint's global batch (its batch x its replicas) divides by
  this run's replica count, the run takes that share: the data position,
  the epoch's order and the learning-rate schedule then carry over exactly
  (`train_guard.resume_world`). Otherwise, and outside a restart, the
  batch is left as given (a mismatch is refused at resume, saying how).
  Collective: call it on every process, after `jdist.init()`.

  Args:
    checkpoint_dir: the run's --checkpoint-dir (None: no checkpoints).
    replica_count: this run's replicas.
    batch_size: this run's --batch-size.

  Returns:
    (batch size to use, a note for the log or None).
  """
  if not checkpoint_dir or int(os.environ.get(RESTART_ENV, "0") or 0) < 1:
    return batch_size, None
  saved = _newest_metadata(checkpoint_dir)
  if saved is None:
    return batch_size, None
  replicas = saved.get("replica_count")
  batch = saved.get("config", {}).get("batch_size")
  # Also when the checkpoint's replicas are this run's: the command's --batch-size is the
  # first run's (2 replicas x 16, then 1 x 32, then 1 again: 32, not 16).
  if not replicas or not batch:
    return batch_size, None
  global_batch = replicas * batch
  if global_batch % replica_count or global_batch // replica_count == batch_size:
    return batch_size, None
  new = global_batch // replica_count
  return new, (f"restart {os.environ[RESTART_ENV]}: the checkpoint was written by {replicas} "
               f"replicas x batch {batch}; {replica_count} replicas take batch {new} each, "
               f"the same global batch of {global_batch}")


def _newest_metadata(directory: str) -> dict | None:
  """The user metadata of the newest readable checkpoint in `directory`, or None (collective)."""
  import jdist  # pylint: disable=g-import-not-at-top
  from jdist import errors  # pylint: disable=g-import-not-at-top
  manager = jdist.CheckpointManager(directory, keep=None)
  try:
    steps = manager.all_steps()  # rank 0's view, on every rank
  except errors.CheckpointError:
    return None  # no directory yet: the resume starts from scratch and says so
  for step in reversed(steps):
    try:
      return manager.read_metadata(step).get("user") or None
    except errors.CheckpointCorruptError:
      continue  # the resume sets it aside and says so
  return None
