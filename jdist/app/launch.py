"""`jdist launch`: runs `mpirun` and makes sure a failed job ends, in bounded time.

    jdist launch --hostfile hosts -np 8 -- jdist train --epochs 5
    jdist launch --mpirun-args "--map-by ppr:2:node" -- python train.py

What plain `mpirun` does not guarantee, measured on a two-node rig
(`benchmarks.cluster`, Open MPI 5.0 / PRRTE 3.0):

* A node whose link goes down is noticed by PRRTE only through TCP
  keepalive, 300 + 9 x 20 s by default; until then mpirun hangs. This
  supervisor passes `oob_tcp_keepalive_*` settings (5 s, then 3 probes 2 s
  apart) unless the environment already sets them.
* Once any rank has aborted (jdist's watchdog), mpirun's order to kill the
  job sits unacknowledged on the lost node's socket, keepalive no longer
  applies, and mpirun hangs for good. The supervisor sees the abort report
  (`jdist.runtime.abort.ABORT_MARKER` on the job's stderr) and ends mpirun
  `--abort-grace` seconds later.
* When PRRTE does notice a lost node it ends the job with exit status 0.
  The supervisor returns 1 and names the host and its ranks (rank 0 prints
  the rank -> host map at `jdist.init()` when launched this way).

The job's output passes through unchanged, apart from that one map line.

With `--max-restarts N` (and a `--hostfile`) a failed job is started again,
up to N times: hosts the failure names are left out for `--cooldown`
seconds, -np follows the healthy slots (or keeps the processes per node of
a fixed -np), and every rank sees `JDIST_RESTART=<k>`; below `--min-nodes`
healthy hosts it stops (`jdist.app.elastic`, docs/multinode.md "Elastic
restarts"). The command is run as given each time: for `jdist train`, give
it `--checkpoint-dir D --checkpoint-every K --resume` from the start.

`--host-discovery SCRIPT` replaces the hostfile with a script's output, read
at each (re)start and every `--discovery-interval` seconds. When the job runs
on fewer processes than the available hosts hold (a lost host past its
cooldown that answers a probe through the launch agent, or a host the
script newly lists), the supervisor waits for the job's next "checkpoint
saved at step S" line, stops it and starts it over the larger set: it
resumes from step S, with the same global batch (`elastic.restart_batch_size`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Sequence

from jdist.app import elastic
from jdist.runtime import abort

KEEPALIVE_DEFAULTS = {"PRTE_MCA_oob_tcp_keepalive_time": "5",
                      "PRTE_MCA_oob_tcp_keepalive_intvl": "2",
                      "PRTE_MCA_oob_tcp_keepalive_probes": "3"}
DEFAULT_ABORT_GRACE_S = 10.0
KILL_GRACE_S = 5.0
EXIT_FAILURE = 1
EXIT_USAGE = 2
# PRRTE's words for a node whose daemon is gone: a lost link or host ("lost
# communication"), or a daemon killed with its node ("failed to report back");
# both were seen on the rig, with exit status 0.
_LOST_DAEMON = ("PRTE has lost communication with a remote daemon",
                "A daemon failed to report back")
_REMOTE_NODE = re.compile(r"Remote daemon:.* on node (\S+)|Remote host:\s+(\S+)")
_SILENT = re.compile(r"ranks? ([\d, ]+) on host (\S+) stopped answering")
# jdist train's words (rank 0) after each checkpoint of its --checkpoint-dir.
_SAVED = re.compile(r"^checkpoint saved at step (\d+)")
DEFAULT_DISCOVERY_INTERVAL_S = 30.0
DEFAULT_PROBE_TIMEOUT_S = 5.0


@dataclasses.dataclass
class JobState:
  """What the supervisor learned from the job's output (thread-safe enough:
  each field is written by one reader and read after the readers end, or
  polled as a flag)."""
  hosts: dict[int, str] = dataclasses.field(default_factory=dict)
  aborted_at: float | None = None
  lost_hosts: list[str] = dataclasses.field(default_factory=list)
  silent: dict[str, list[int]] = dataclasses.field(default_factory=dict)
  saved_step: int | None = None   # the job's newest "checkpoint saved at step S"
  stopped_for: str | None = None  # why the supervisor stopped a healthy job
  _after_lost_daemon: bool = False

  def read(self, line: str) -> bool:
    """Takes in one output line; returns whether to pass it on to the user."""
    if line.startswith(abort.HOSTS_MARKER):
      self.hosts = abort.parse_hosts(line)
      return False
    if line.startswith(abort.ABORT_MARKER) and self.aborted_at is None:
      self.aborted_at = time.monotonic()
    if any(words in line for words in _LOST_DAEMON):
      self._after_lost_daemon = True
    match = _REMOTE_NODE.search(line)
    host = match and (match.group(1) or match.group(2))
    if host and self._after_lost_daemon and host not in self.lost_hosts:
      self.lost_hosts.append(host)
    for ranks, host in _SILENT.findall(line):
      self.silent.setdefault(host, sorted({int(r) for r in ranks.split(",")}))
    saved = _SAVED.match(line)
    if saved:
      self.saved_step = int(saved.group(1))
    return True

  def lost(self) -> list[str]:
    """Hosts the output names as lost (PRRTE's lost daemons, then the watchdog's silent hosts)."""
    return self.lost_hosts + [h for h in self.silent if h not in self.lost_hosts]

  def failure(self) -> str | None:
    """A one-line account of how the job failed, if its output says it did."""
    lost = []
    for host in self.lost():
      ranks = [r for r, h in sorted(self.hosts.items()) if h == host] or self.silent.get(host)
      lost.append(f"host {host}" + (f" (ranks {', '.join(map(str, ranks))})" if ranks else ""))
    if lost:
      return "lost " + "; ".join(lost)
    if self.aborted_at is not None:
      return "a rank aborted the job (its report is above)"
    return None


def _pump(stream: IO[str], sink: IO[str], state: JobState) -> None:
  for line in stream:
    if state.read(line):
      sink.write(line)
      sink.flush()


def _environment(extra: dict[str, str] | None = None) -> dict[str, str]:
  env = dict(os.environ)
  for name, value in KEEPALIVE_DEFAULTS.items():
    env.setdefault(name, value)
  env[abort.LAUNCH_ENV] = "1"
  env.update(extra or {})
  return env


def mpirun_argv(command: Sequence[str], *, mpirun: str = "mpirun", hostfile: str | None = None,
                processes: int | None = None, mpirun_args: Sequence[str] = ()) -> list[str]:
  """The mpirun command line the supervisor runs."""
  argv = [mpirun]
  if hostfile:
    argv += ["--hostfile", hostfile]
  if processes:
    argv += ["-np", str(processes)]
  if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-run-as-root" not in mpirun_args:
    argv.append("--allow-run-as-root")
  return argv + list(mpirun_args) + ["-x", abort.LAUNCH_ENV] + list(command)


def _stop(process: subprocess.Popen) -> None:
  """SIGTERM to mpirun's process group, then SIGKILL if it lingers."""
  for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
    try:
      os.killpg(process.pid, sig)
    except ProcessLookupError:
      return
    try:
      process.wait(timeout=wait)
      return
    except subprocess.TimeoutExpired:
      continue


def supervise(argv: Sequence[str], *, abort_grace: float = DEFAULT_ABORT_GRACE_S,
              env: dict[str, str] | None = None, stdout: IO[str] | None = None,
              stderr: IO[str] | None = None,
              watch: Callable[[JobState], str | None] | None = None) -> tuple[int, JobState]:
  """Runs `argv` (an mpirun command) to its end; returns (exit status, what was seen).

  The exit status is mpirun's, except that a job whose output shows a lost
  node or an abort never returns 0, and a job that aborted is ended
  `abort_grace` seconds later if mpirun has not ended it. `watch`, polled
  while the job runs, may stop it: its reason goes to `JobState.stopped_for`.
  """
  stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
  state = JobState()
  process = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, errors="replace",
                             start_new_session=True)
  readers = [threading.Thread(target=_pump, args=(process.stdout, stdout, state), daemon=True),
             threading.Thread(target=_pump, args=(process.stderr, stderr, state), daemon=True)]
  for reader in readers:
    reader.start()
  stopped = False
  try:
    while process.poll() is None:
      if state.aborted_at is not None and time.monotonic() - state.aborted_at > abort_grace:
        stderr.write(f"jdist launch: mpirun still runs {abort_grace:g} s after the job aborted "
                     f"(it waits for a node it cannot reach); stopping it.\n")
        _stop(process)
        stopped = True
        break
      reason = watch(state) if watch is not None and state.aborted_at is None else None
      if reason is not None and process.poll() is None:
        state.stopped_for = reason
        _stop(process)
        break
      time.sleep(0.1)
  except KeyboardInterrupt:
    _stop(process)
    return 130, state
  for reader in readers:
    reader.join(timeout=2.0)  # a lost node's daemon may hold the pipes open
  code = process.wait()
  if state.stopped_for is not None:
    return code, state
  failure = state.failure()
  if failure is not None or stopped:
    stderr.write(f"jdist launch: the job failed: {failure or 'stopped'}.\n")
    stderr.flush()
    if code <= 0:  # PRRTE reports a lost node with status 0; a signal is negative here
      code = EXIT_FAILURE
  return code, state


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jdist launch", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--hostfile", help="mpirun hostfile (`HOST slots=N` lines)")
  parser.add_argument("--host-discovery", metavar="SCRIPT",
                      help="instead of --hostfile: an executable printing `HOST[:SLOTS]` or "
                      "`HOST slots=N` lines, run at each (re)start and periodically")
  parser.add_argument("--discovery-interval", type=float, default=DEFAULT_DISCOVERY_INTERVAL_S,
                      metavar="SECONDS", help="how often to look for more hosts while the job "
                      "runs (the discovery script, or probes of hosts past their cooldown)")
  parser.add_argument("--probe-timeout", type=float, default=DEFAULT_PROBE_TIMEOUT_S,
                      metavar="SECONDS", help="a hostfile host answers `AGENT HOST true` within "
                      "this long, or is not back")
  parser.add_argument("-np", "--np", type=int, dest="processes", help="number of processes")
  parser.add_argument("--mpirun", default="mpirun", help="the mpirun to run")
  parser.add_argument("--mpirun-args", default="", help="more mpirun options, one string")
  parser.add_argument("--abort-grace", type=float, default=DEFAULT_ABORT_GRACE_S,
                      help="seconds mpirun may take to end after a rank aborted the job")
  parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                      help="start a failed job again up to N times, without the hosts it lost")
  parser.add_argument("--min-nodes", type=int, default=1, metavar="M",
                      help="stop instead of restarting on fewer healthy hosts than this")
  parser.add_argument("--cooldown", type=float, default=elastic.DEFAULT_COOLDOWN_S,
                      metavar="SECONDS", help="a lost host is tried again after this long")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """`jdist launch ... -- CMD...`; returns the exit status."""
  args = build_parser().parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    sys.stderr.write("jdist launch: error: no command: give it after `--` "
                     "(jdist launch -np 2 -- jdist train).\n")
    return EXIT_USAGE
  if args.processes is not None and args.processes < 1:
    sys.stderr.write(f"jdist launch: error: -np {args.processes} must be at least 1.\n")
    return EXIT_USAGE
  if not args.abort_grace > 0:
    sys.stderr.write(f"jdist launch: error: --abort-grace {args.abort_grace} must be positive.\n")
    return EXIT_USAGE
  for name, value, least in (("--max-restarts", args.max_restarts, 0),
                             ("--min-nodes", args.min_nodes, 1)):
    if value < least:
      sys.stderr.write(f"jdist launch: error: {name} {value} must be at least {least}.\n")
      return EXIT_USAGE
  if not args.cooldown >= 0:
    sys.stderr.write(f"jdist launch: error: --cooldown {args.cooldown} must be >= 0.\n")
    return EXIT_USAGE
  for name, value in (("--discovery-interval", args.discovery_interval),
                      ("--probe-timeout", args.probe_timeout)):
    if not value > 0:
      sys.stderr.write(f"jdist launch: error: {name} {value} must be positive.\n")
      return EXIT_USAGE
  if args.hostfile and args.host_discovery:
    sys.stderr.write("jdist launch: error: give --hostfile or --host-discovery, not both.\n")
    return EXIT_USAGE
  if args.max_restarts or args.host_discovery:
    from jdist.app.launch_elastic import Elastic  # pylint: disable=g-import-not-at-top
    try:
      return Elastic(command, args).run()
    except elastic.ElasticError as err:
      sys.stderr.write(f"jdist launch: error: {err}.\n")
      return EXIT_USAGE
  argv = mpirun_argv(command, mpirun=args.mpirun, hostfile=args.hostfile,
                     processes=args.processes, mpirun_args=shlex.split(args.mpirun_args))
  code, _ = supervise(argv, abort_grace=args.abort_grace, env=_environment())
  return code
