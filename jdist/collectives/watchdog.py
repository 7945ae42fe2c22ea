"""Deadlines for cross-process exchanges, and a diagnosis when one passes.

A rank that dies is handled by the MPI launcher (Open MPI ends the job about
a second later). A rank that is alive but stalled (a loop, a deadlock, a slow
filesystem) is not: every other rank would wait in its next collective
forever. The watchdog turns that into an error:

* Every wait for other ranks is tracked: host-side exchanges through
  `waiting(label)`, and compiled train steps through `step_dispatched`, whose
  completion a monitor thread awaits.
* A background thread checks the current wait against the deadline and
  answers progress queries from other ranks on a communicator of its own.
* When a wait passes the deadline, the thread asks every rank where it is,
  prints which ranks have not arrived (and the step), and aborts the MPI job
  so that every process exits non-zero.

Work on one rank between exchanges (rank 0 evaluating or writing a
checkpoint) never counts: only time spent waiting in an exchange does.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from typing import Any

_QUERY_TAG = 7401
_REPLY_TAG = 7402
_POLL_S = 0.1


class Watchdog:
  """Tracks this rank's waits; diagnoses and aborts when one overruns."""

  def __init__(self, comm, mpi, *, timeout: float):
    self.comm = comm
    self._mpi = mpi
    self.rank = comm.Get_rank()
    self.size = comm.Get_size()
    self.timeout = timeout
    self._lock = threading.Lock()
    self._wait: tuple[str, float] | None = None  # (what, since), host side
    self._step_wait: tuple[str, float] | None = None  # pending compiled step
    self._dispatched = 0
    self._completed = 0
    self._last_done = time.monotonic()
    self._last_activity = time.monotonic()
    self._steps: queue.Queue = queue.Queue()
    self._pending_sends: list[Any] = []
    self._started = False
    self.on_timeout = self._abort  # tests may replace it

  def start(self) -> None:
    if self._started or self.size < 2:
      return
    self._started = True
    threading.Thread(target=self._serve, name="jdist-watchdog", daemon=True).start()
    threading.Thread(target=self._monitor_steps, name="jdist-step-monitor", daemon=True).start()

  @property
  def step(self) -> int:
    """Steps dispatched so far (the step a waiting rank is in is `step`)."""
    return self._dispatched

  @contextlib.contextmanager
  def waiting(self, label: str):
    """Marks a host-side wait for other ranks, under the deadline."""
    with self._lock:
      self._wait = (label, time.monotonic())
    try:
      yield
    finally:
      with self._lock:
        self._wait = None
        self._last_activity = time.monotonic()

  def step_dispatched(self, marker) -> None:
    """Registers a dispatched compiled step; `marker` is one of its outputs."""
    with self._lock:
      self._dispatched += 1
      self._last_activity = time.monotonic()
      number = self._dispatched
    if self._started:
      self._steps.put((number, marker, time.monotonic()))

  def _monitor_steps(self) -> None:
    while True:
      number, marker, dispatched_at = self._steps.get()
      with self._lock:
        # A queued step only starts waiting once the one before it is done.
        self._step_wait = (f"train step {number}", max(dispatched_at, self._last_done))
      try:
        marker.block_until_ready()
      except Exception:  # pylint: disable=broad-except
        pass  # the step failed; its caller sees the error
      with self._lock:
        self._step_wait = None
        self._completed = number
        self._last_done = self._last_activity = time.monotonic()

  def status(self) -> dict[str, Any]:
    """Where this rank is, as reported to a rank that diagnoses a stall."""
    now = time.monotonic()
    with self._lock:
      current = self._wait or self._step_wait
      return {
          "rank": self.rank,
          "dispatched": self._dispatched,
          "completed": self._completed,
          "waiting_in": current[0] if current else None,
          "waiting_s": now - current[1] if current else 0.0,
          "idle_s": now - self._last_activity,
      }

  def _answer_queries(self) -> None:
    mpi_status = self._mpi.Status()
    while self.comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=_QUERY_TAG, status=mpi_status):
      source = mpi_status.Get_source()
      self.comm.recv(source=source, tag=_QUERY_TAG)
      self._pending_sends.append(self.comm.isend(self.status(), dest=source, tag=_REPLY_TAG))
    self._pending_sends = [r for r in self._pending_sends if not r.Test()]

  def _overrun(self) -> tuple[str, float] | None:
    now = time.monotonic()
    with self._lock:
      for wait in (self._wait, self._step_wait):
        if wait is not None and now - wait[1] > self.timeout:
          return wait[0], now - wait[1]
    return None

  def _serve(self) -> None:
    while True:
      self._answer_queries()
      overrun = self._overrun()
      if overrun is not None:
        self.on_timeout(self._diagnose(*overrun))
        return
      time.sleep(_POLL_S)

  def _diagnose(self, label: str, waited: float) -> str:
    for peer in range(self.size):
      if peer != self.rank:
        self._pending_sends.append(self.comm.isend("where", dest=peer, tag=_QUERY_TAG))
    replies: dict[int, dict[str, Any]] = {}
    mpi_status = self._mpi.Status()
    deadline = time.monotonic() + min(5.0, max(1.0, self.timeout / 2))
    while len(replies) < self.size - 1 and time.monotonic() < deadline:
      self._answer_queries()
      while self.comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=_REPLY_TAG, status=mpi_status):
        reply = self.comm.recv(source=mpi_status.Get_source(), tag=_REPLY_TAG)
        replies[reply["rank"]] = reply
      time.sleep(0.02)
    return describe_stall(self.rank, self.size, label, waited, self.timeout, replies)

  def _abort(self, message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    self.comm.Abort(1)


def describe_stall(rank: int, size: int, label: str, waited: float, timeout: float,
                   replies: dict[int, dict[str, Any]]) -> str:
  """The watchdog's report: who is missing, and where everyone is."""
  lines = [f"jdist watchdog: rank {rank} waited {waited:.1f} s in {label} for the "
           f"other ranks (limit {timeout:g} s; raise it with jdist.init(timeout=...) "
           f"or the JDIST_TIMEOUT environment variable)."]
  missing = []
  for peer in range(size):
    if peer == rank:
      continue
    reply = replies.get(peer)
    if reply is None:
      missing.append(peer)
      lines.append(f"  rank {peer}: MISSING - did not answer (stalled holding the "
                   f"Python interpreter, or hung)")
    elif reply["waiting_in"] is None:
      missing.append(peer)
      lines.append(f"  rank {peer}: MISSING - not in any exchange for "
                   f"{reply['idle_s']:.1f} s; it has dispatched {reply['dispatched']} "
                   f"steps, completed {reply['completed']}")
    else:
      lines.append(f"  rank {peer}: waiting in {reply['waiting_in']} for "
                   f"{reply['waiting_s']:.1f} s")
  if missing:
    names = ", ".join(str(m) for m in missing)
    lines.append(f"Rank(s) {names} did not reach {label}. Aborting the job so no rank "
                 f"hangs forever.")
  else:
    lines.append("Every rank is waiting: the ranks are in different exchanges "
                 "(diverging control flow). Aborting the job.")
  return "\n".join(lines)

