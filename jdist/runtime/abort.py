"""Ending the whole MPI job from one rank, in bounded time.

`MPI_Abort` asks the launcher to kill every rank. When a node has dropped off
the network the launcher cannot reach that node's daemon, and the call can
block the aborting rank itself (measured on a two-node rig: survivors still
alive 90 s after aborting). So every abort arms a timer first: if the process
still runs `EXIT_AFTER_ABORT_S` later, it ends itself with the same code.
Survivors then always exit non-zero; `jdist launch` ends an `mpirun` that
still waits for the lost node (see `jdist.app.launch`).

Every abort report ends with a line starting with `ABORT_MARKER`, which
`jdist launch` reads to know the job is over.
"""

from __future__ import annotations

import os
import sys
import threading

ABORT_MARKER = "jdist: aborting the MPI job"
EXIT_AFTER_ABORT_S = 5.0


def abort_job(comm, message: str, rank: int, code: int = 1) -> None:
  """Prints `message`, then ends every rank of `comm`'s job with exit `code`.

  Returns only if `comm.Abort` does and the exit timer has not fired (never
  in practice: this process ends either way).
  """
  sys.stderr.write(f"{message}\n{ABORT_MARKER} (rank {rank}, exit code {code})\n")
  sys.stderr.flush()
  timer = threading.Timer(EXIT_AFTER_ABORT_S, os._exit, (code,))  # pylint: disable=protected-access
  timer.daemon = True
  timer.start()
  comm.Abort(code)


def install_excepthook(comm, rank: int) -> None:
  """Makes an uncaught exception on this rank end the job at once.

  Without it the failed rank waits in `MPI_Finalize` and the others in their
  next exchange until the watchdog's deadline.
  """
  previous = sys.excepthook

  def abort_on_uncaught(kind, value, traceback):
    previous(kind, value, traceback)
    if issubclass(kind, KeyboardInterrupt):
      return  # the launcher forwards the interrupt to every rank
    abort_job(comm, f"jdist: rank {rank} stopped on an uncaught {kind.__name__}; aborting the "
                    f"MPI job so the other ranks do not wait for it.", rank)

  sys.excepthook = abort_on_uncaught


# `jdist launch` sets LAUNCH_ENV in every rank's environment; rank 0 then
# prints which host each rank runs on, so the supervisor can name a lost
# node's ranks even when the launcher, not jdist, notices the loss.
LAUNCH_ENV = "JDIST_LAUNCH"
HOSTS_MARKER = "[jdist-launch] hosts"


def announce_hosts(hosts: list[str]) -> None:
  """Prints the rank -> host map for `jdist launch` (rank 0, once, at init)."""
  if os.environ.get(LAUNCH_ENV):
    sys.stdout.write(f"{HOSTS_MARKER} " + " ".join(f"{r}:{h}" for r, h in enumerate(hosts))
                     + "\n")
    sys.stdout.flush()


def parse_hosts(line: str) -> dict[int, str]:
  """The rank -> host map of an `announce_hosts` line."""
  pairs = line[len(HOSTS_MARKER):].split()
  return {int(rank): host for rank, host in (pair.split(":", 1) for pair in pairs)}
