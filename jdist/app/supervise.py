"""Supervising one mpirun: its output, a failed or lost node, a bounded end.

`supervise(argv)` runs mpirun, passes its output through, and returns its
exit status once the job has ended (see `jdist.app.launch` for why plain
mpirun does not end in bounded time after a lost node): `JobState` reads
the job's output for the abort report, PRRTE's lost-daemon words and
`jdist train`'s "checkpoint saved at step S"; `mpirun_argv` and
`environment` build the command and the keepalive settings. Both `jdist
launch` and its elastic restart loop (`jdist.app.launch_elastic`) use it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Sequence

from jdist.runtime import abort

# A silent PRRTE daemon is declared lost after 1 s idle + 3 unanswered probes
# 1 s apart: on the rig a link down ended the job 3.9-4.6 s after the fault
# (5 runs), against 7.7-11.9 s at 5 s + 3 x 2 s. The kernel answers probes,
# so a busy node still answers; three lost in a row is what a dead link looks
# like (two could be a congested moment).
KEEPALIVE_DEFAULTS = {"PRTE_MCA_oob_tcp_keepalive_time": "1",
                      "PRTE_MCA_oob_tcp_keepalive_intvl": "1",
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
# jdist train --shrink's words (the surviving rank 0) when its run completed.
SHRINK_FINISHED = "jdist train --shrink: finished"


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
  shrink_finished: bool = False   # `jdist train --shrink`'s survivors finished the run
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
    if line.startswith(SHRINK_FINISHED):
      self.shrink_finished = True
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


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
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
