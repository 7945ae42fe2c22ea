"""`jdist launch`'s elastic loop: restart without lost hosts, grow back onto more.

`jdist.app.launch.main` runs `Elastic` under `--max-restarts N` or
`--host-discovery SCRIPT`; the decisions themselves (which hosts, how many
processes, whether to grow) are `jdist.app.elastic`'s pure functions. Each
run is one `supervise.supervise` of mpirun over a hostfile written for it:

  * a run that fails is started again (up to N times) without the hosts it
    lost, each left out for `--cooldown` seconds;
  * while a run goes on, every `--discovery-interval` seconds the loop looks
    for more hosts: the discovery script's output, or the hostfile's hosts
    past their cooldown that answer `AGENT HOST true` (the launch agent,
    `$PRTE_MCA_plm_ssh_agent` or ssh) within `--probe-timeout`. If the job
    would get more processes there, the loop waits for its next
    "checkpoint saved at step S" line, stops it and starts it over the
    larger set (these restarts do not count against --max-restarts).

Every run sees `JDIST_RESTART=<k>`, k counting both kinds of restart.
With `--shrink`, every run is a ULFM run (`jdist.app.launch_shrink`): lost
processes are shrunk past within a run, and only what ends a run (a lost
node) costs a restart.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import IO, Sequence

from jdist.app import elastic
from jdist.app import launch_shrink
from jdist.app import supervise


def probe_agent(mpirun_args: Sequence[str]) -> list[str]:
  """The launch agent PRRTE uses: --prtemca/--mca plm_ssh_agent, $PRTE_MCA_plm_ssh_agent, ssh."""
  args = list(mpirun_args)
  for i, word in enumerate(args[:-2]):
    if word in ("--prtemca", "--mca") and args[i + 1] in ("plm_ssh_agent", "plm_rsh_agent"):
      return shlex.split(args[i + 2])
  agent = os.environ.get("PRTE_MCA_plm_ssh_agent") or os.environ.get("OMPI_MCA_plm_rsh_agent")
  return shlex.split(agent) if agent else ["ssh", "-o", "BatchMode=yes"]


def answers(agent: Sequence[str], host: str, timeout: float) -> bool:
  """Whether `AGENT HOST true` succeeds within `timeout` seconds."""
  try:
    return subprocess.run([*agent, host, "true"], capture_output=True, timeout=timeout,
                          check=False).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


class Elastic:
  """Runs the job; again without its lost hosts; again over more hosts when they come."""

  def __init__(self, command: Sequence[str], args: argparse.Namespace, *,
               stdout: IO[str] | None = None, stderr: IO[str] | None = None,
               blacklist: elastic.Blacklist | None = None):
    self.command, self.args = list(command), args
    self.stdout, self.stderr = stdout or sys.stdout, stderr or sys.stderr
    self.blacklist = blacklist or elastic.Blacklist(args.cooldown)
    self.discovery = getattr(args, "host_discovery", None)
    self.interval = getattr(args, "discovery_interval", elastic.DEFAULT_DISCOVERY_INTERVAL_S)
    self.probe_timeout = getattr(args, "probe_timeout", elastic.DEFAULT_PROBE_TIMEOUT_S)
    self.agent = probe_agent(shlex.split(args.mpirun_args))
    self.shrink = getattr(args, "shrink", False)  # each run under ULFM (jdist.app.launch_shrink)
    if self.discovery:
      self.hosts = elastic.discover(self.discovery)
      if not self.hosts:
        raise elastic.ElasticError(f"host discovery {self.discovery} lists no host to start on")
    else:
      self.hosts = elastic.read_hostfile(args.hostfile) if args.hostfile else None
    self.first = args.processes or (sum(h.slots for h in self.hosts) if self.hosts else None)
    self.per_node = None
    self.names: dict[str, str] = {}  # hostfile line -> the name the host calls itself
    self.grow: tuple[list[elastic.Host], int] | None = None  # set by the watch: where to go
    if self.hosts and args.processes:
      if args.processes > sum(h.slots for h in self.hosts):
        raise elastic.ElasticError(
            f"-np {args.processes} is more than the {sum(h.slots for h in self.hosts)} slots "
            f"of {args.hostfile or 'the discovered hosts'}; with --max-restarts every process "
            f"needs a slot")
      used = elastic.used_hosts(self.hosts, args.processes)
      self.per_node = -(-args.processes // used)

  def say(self, text: str) -> None:
    self.stderr.write(f"jdist launch: {text}\n")
    self.stderr.flush()

  def run(self) -> int:
    """Runs the job until it succeeds or cannot go on; returns the exit status."""
    workdir = tempfile.mkdtemp(prefix="jdist-launch-")  # each run's hostfile
    try:
      return self._runs(workdir)
    finally:
      shutil.rmtree(workdir, ignore_errors=True)

  # Which hosts ---------------------------------------------------------------

  def available(self, running: Sequence[elastic.Host]) -> list[elastic.Host] | None:
    """The hosts the job could run on now, or None if discovery failed (said why)."""
    if self.discovery:
      try:
        return self.blacklist.healthy(elastic.discover(self.discovery))
      except elastic.ElasticError as err:
        self.say(f"warning: {err}; keeping the current hosts.")
        return None
    current = {h.name for h in running}
    return [h for h in self.blacklist.healthy(self.hosts)
            if h.name in current or answers(self.agent, h.name, self.probe_timeout)]

  def _watcher(self, hosts, processes):
    """`supervise`'s watch: the reason to stop the run to grow, once it may."""
    checked, pending = [time.monotonic()], []

    def watch(state: supervise.JobState) -> str | None:
      now = time.monotonic()
      if not pending and now - checked[0] >= self.interval:
        checked[0] = now
        available = self.available(hosts)
        grown = available and elastic.grow_to(hosts, processes, available,
                                              self.args.processes, self.per_node)
        if grown:
          pending.append((grown, state.saved_step))
          self.say(f"{self._joined(hosts, grown[0])}: stopping the job at its next checkpoint "
                   f"to continue on {grown[1]} of {self.first} processes.")
      if pending and state.saved_step is not None and state.saved_step != pending[0][1]:
        self.grow = pending[0][0]
        return f"grow at step {state.saved_step}"
      return None
    return watch

  def _joined(self, running, grown) -> str:
    current = {h.name for h in running}
    words = [f"host {self.names.get(h.name, h.name)} is "
             + ("back" if self.blacklist.lost_before(h.name) else "new")
             for h in grown if h.name not in current]
    return "; ".join(words)

  def _learn_names(self, state: supervise.JobState, hosts, processes) -> None:
    if not hosts or not state.hosts:
      return
    try:
      placed = elastic.placement(hosts, processes)
    except elastic.ElasticError:
      return
    for rank, name in state.hosts.items():
      if rank < len(placed):
        self.names.setdefault(placed[rank], name)

  # The loop ------------------------------------------------------------------

  def _runs(self, workdir: str) -> int:
    hosts, processes, code = self.hosts, self.first, supervise.EXIT_FAILURE
    restart, failures = 0, 0
    cache = elastic.compile_cache_env(dict(os.environ))
    while True:
      hostfile = (elastic.write_hostfile(hosts, os.path.join(workdir, f"hosts.{restart}"))
                  if hosts else None)
      extra = (launch_shrink.mpirun_args(self.args) if self.shrink
               else shlex.split(self.args.mpirun_args))
      for name in (elastic.RESTART_ENV, *cache):  # to the ranks on every node
        extra += ["-x", name]
      argv = supervise.mpirun_argv(self.command, mpirun=self.args.mpirun, hostfile=hostfile,
                                processes=processes, mpirun_args=extra)
      self.grow = None
      env = {elastic.RESTART_ENV: str(restart), **cache,
             **(launch_shrink.environment(self.args) if self.shrink else {})}
      code, state = supervise.supervise(
          argv, abort_grace=self.args.abort_grace, env=supervise.environment(env),
          stdout=self.stdout, stderr=self.stderr,
          watch=self._watcher(hosts, processes) if hosts else None)
      if self.shrink:
        code = launch_shrink.outcome(code, state, self.stderr)
      self._learn_names(state, hosts, processes)
      restart += 1
      if self.grow is not None:
        grown, more = self.grow
        self.say(f"restart {restart}: {self._joined(hosts, grown)}; continuing on {more} of "
                 f"{self.first} processes from step {state.saved_step}")
        hosts, processes = grown, more
        continue
      if code in (0, 130):
        return code
      reason = self.account(state, code, hosts, processes)
      if reason is None:
        return code
      if failures == self.args.max_restarts:
        self.say(f"giving up: {reason}, and the job has been restarted {failures} time(s) "
                 f"(--max-restarts {self.args.max_restarts}).")
        return code
      failures += 1
      if self.hosts:
        found = self.available([]) if self.discovery else self.blacklist.healthy(self.hosts)
        hosts = found if found is not None else self.blacklist.healthy(hosts)
        if len(hosts) < self.args.min_nodes:
          self.say(f"giving up: {reason}; {len(hosts)} healthy host(s) left "
                   f"({', '.join(h.name for h in hosts) or 'none'}), fewer than --min-nodes "
                   f"{self.args.min_nodes} (left out: {', '.join(self.blacklist.blocked())}).")
          return code
        processes = elastic.processes_for(hosts, self.args.processes, self.per_node)
      where = (f" on {', '.join(f'{h.name} slots={h.slots}' for h in hosts)}"
               if hosts else "")
      self.say(f"restart {restart}: {reason}; continuing on {processes} of {self.first} "
               f"processes{where}" if processes else f"restart {restart}: {reason}")

  def account(self, state: supervise.JobState, code: int, hosts, processes) -> str | None:
    """Why the run failed, with its lost hosts blacklisted; None: it cannot go on."""
    lost = state.lost()
    if not lost:
      return (f"the job failed without losing a host (exit status {code}; an error in the "
              f"command itself is retried too, and counts against --max-restarts)")
    if not hosts:
      self.say(f"giving up: {state.failure()}, and without --hostfile there is no host list "
               f"to leave it out of.")
      return None
    try:
      entries = elastic.lost_entries(lost, state.hosts, hosts, processes, state.silent)
    except elastic.ElasticError as err:
      self.say(f"giving up: {err}.")
      return None
    for entry in entries:
      self.blacklist.add(entry)
    return state.failure()
