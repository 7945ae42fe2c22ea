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

After the report, what the job prints while it dies is not jdist's: when a
rank ends, JAX's coordination client on every other rank sees its service
go away and aborts with a C++ stack trace ("Terminating process because
the JAX distributed service detected fatal errors", `grpc_status:14 ...
Socket closed`), measured 0.14 s before the launcher's SIGTERM arrived.
So the aborting rank tells its peers first (`QUIET_TAG`, answered by
their watchdogs) and every rank sends its own standard error to
/dev/null from then on, unless `JDIST_DEBUG` is set.
"""

from __future__ import annotations

import os
import sys
import threading
import time

ABORT_MARKER = "jdist: aborting the MPI job"
EXIT_AFTER_ABORT_S = 5.0
DEBUG_ENV = "JDIST_DEBUG"  # set: keep every library's output while the job ends
# "The job ends" and its answer, on the watchdog's communicator (7401-7403:
# the watchdog's queries, replies and departures).
QUIET_TAG, QUIET_ACK_TAG = 7404, 7405
_acks_sent: list = []  # kept until the process ends: MPI may still read them
_QUIET_WAIT_S = 2.0  # the peers' watchdogs poll every 0.1 s, even while their main thread stalls


def debugging() -> bool:
  """Whether `JDIST_DEBUG` asks for every library's output (any value but 0/empty)."""
  return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def silence_stderr() -> None:
  """Sends this process's standard error to /dev/null (not with `JDIST_DEBUG`).

  For the moments after an abort report: what follows is other libraries'
  noise about the job ending, and it would bury the report.
  """
  if debugging():
    return
  sys.stderr.flush()
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  os.close(devnull)


def _tell_peers_the_job_ends(comm, rank: int) -> None:
  """Asks every other rank's watchdog to go quiet; waits (briefly) until they have."""
  peers = [peer for peer in range(comm.Get_size()) if peer != rank]
  sends = [comm.isend(rank, dest=peer, tag=QUIET_TAG) for peer in peers]
  acks = [comm.irecv(source=peer, tag=QUIET_ACK_TAG) for peer in peers]
  deadline = time.monotonic() + _QUIET_WAIT_S  # a lost peer must not hold up the abort
  while (sends or acks) and time.monotonic() < deadline:
    sends = [request for request in sends if not request.Test()]
    acks = [request for request in acks if not request.Test()]
    time.sleep(0.01)


def quiet_if_told(comm, mpi) -> None:
  """Silences this rank once a peer said the job ends, and says it did (watchdog thread)."""
  status = mpi.Status()
  told = []
  while comm.Iprobe(source=mpi.ANY_SOURCE, tag=QUIET_TAG, status=status):
    told.append(comm.recv(source=status.Get_source(), tag=QUIET_TAG))
  if told:
    silence_stderr()
    _acks_sent.extend(comm.isend(True, dest=peer, tag=QUIET_ACK_TAG) for peer in told)


def end_quietly(comm, rank: int) -> None:
  """Before an abort: this rank, then the peers (told over the watchdog's `comm`), go quiet.

  This rank first: its report is out, and when several ranks abort at once
  (each watchdog finding the same stall) none answers the others' request,
  so each waits out `_QUIET_WAIT_S`; the first to abort would otherwise end
  the coordination service while the others can still print its noise.
  """
  silence_stderr()
  if comm.Get_size() > 1:
    _tell_peers_the_job_ends(comm, rank)


def abort_job(comm, message: str, rank: int, code: int = 1) -> None:
  """Prints `message`, then ends every rank of `comm`'s job with exit `code`.

  `comm` is the watchdog's communicator, on which the peers hear that the
  job ends (`end_quietly`).

  Returns only if `comm.Abort` does and the exit timer has not fired (never
  in practice: this process ends either way).
  """
  sys.stderr.write(f"{message}\n{ABORT_MARKER} (rank {rank}, exit code {code})\n")
  sys.stderr.flush()
  timer = threading.Timer(EXIT_AFTER_ABORT_S, os._exit, (code,))  # pylint: disable=protected-access
  timer.daemon = True
  timer.start()
  end_quietly(comm, rank)
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
