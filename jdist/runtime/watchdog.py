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
* When a wait passes the deadline, the thread asks every rank where it is
  (which exchange it waits in, which step it last finished, the line its main
  thread is on), prints which ranks have not arrived, and aborts the MPI job
  so that every process exits non-zero.

Work on one rank between exchanges (rank 0 evaluating or writing a
checkpoint) does not count against that rank: only the other ranks' waits
have a deadline, so such work must end within it. Tracing and compiling do
not count at all: a peer whose main thread is inside JAX's tracer or compiler
(a first step compiling slowly on one rank) extends the deadline, up to
`compile_grace` seconds per wait.

An uncaught exception on one rank would otherwise leave that process waiting
in `MPI_Finalize` and the others in their next exchange until the deadline:
`start()` chains a `sys.excepthook` that prints the traceback and aborts the
job at once. A rank that ends without an exception (`sys.exit`, a loop left
early on one rank) announces at exit how many steps and host exchanges it
ran; a peer that has waited `DEPARTURE_GRACE_S` in a later one aborts the job
then, instead of at the deadline.

Ranks whose control flow diverged are found without waiting for the
deadline either: a rank waiting in compiled step N while another has
dispatched fewer than N steps and waits in a host exchange (typically the
structure check of a step that only it re-traces, for a batch of another
shape or dtype, or the exchange after the loop of a rank that ran fewer
steps) can never be joined. Once both have waited `DIVERGENCE_GRACE_S`, the
job is aborted with a report naming the rank, and what its re-trace changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import sys
import threading
import time
from typing import Any

import jax

from jdist.runtime import abort
from jdist.runtime import flight_recorder
from jdist.runtime import flight_report
from jdist.runtime import watchdog_peers
from jdist.runtime.stall_report import describe_departure
from jdist.runtime.stall_report import describe_divergence  # re-exported
from jdist.runtime.stall_report import find_divergence  # re-exported
from jdist.runtime.stall_report import describe_stall  # re-exported
from jdist.runtime.stall_report import in_jax_compiler
from jdist.runtime.stall_report import is_missing
from jdist.runtime.stall_report import user_location

_DEPART_TAG = 7403
DEPARTURE_GRACE_S = 5.0  # a wait this old, that a departed rank never reached, is a stall
DIVERGENCE_GRACE_S = 5.0  # waits this old, in a step and a host exchange that exclude each other
_POLL_S = 0.1
_LEAVING_ALONE_S = 1.0  # at exit: peers that have not left by then still run


def trace_signature(args: Any) -> list[tuple[str, str]]:
  """[(argument path, "dtype[shape]"), ...] of a traced step's array arguments."""
  out = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(args):
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
      shape = ", ".join(str(d) for d in leaf.shape)
      out.append((f"argument {jax.tree_util.keystr(path)}", f"{leaf.dtype}[{shape}]"))
  return out


@dataclasses.dataclass
class _Wait:
  """One wait for other ranks: what it is, when it began, when it expires."""
  label: str
  since: float
  deadline: float
  grace_s: float = 0.0  # deadline extensions granted to compiling peers
  number: int = 0  # this rank's count of steps (or host exchanges) up to this one
  host: bool = False  # a host-side exchange (else a compiled step)


class Watchdog:
  """Tracks this rank's waits; diagnoses and aborts when one overruns.

  Args:
    comm: an MPI communicator of the watchdog's own (a duplicate).
    mpi: the `mpi4py.MPI` module.
    timeout: seconds a wait may last before the job is aborted.
    compile_grace: most extra seconds one wait is extended while a peer is
      tracing or compiling. Default: max(600, 10 * timeout).
  """

  def __init__(self, comm, mpi, *, timeout: float, compile_grace: float | None = None):
    self.comm = comm
    self._mpi = mpi
    self.rank = comm.Get_rank()
    self.size = comm.Get_size()
    self.timeout = timeout
    self.compile_grace = max(600.0, 10 * timeout) if compile_grace is None else compile_grace
    self._lock = threading.Lock()
    self._host_waits: list[_Wait] = []  # innermost last
    self._step_wait: _Wait | None = None  # the pending compiled step
    self._dispatched = 0
    self._completed = 0
    self._calls: dict[str, int] = {}
    self._last_dispatched: str | None = None
    self._last_completed: str | None = None
    self._last_done = time.monotonic()
    self._last_activity = time.monotonic()
    self._steps: queue.Queue = queue.Queue()
    self._peers = watchdog_peers.Peers(comm, mpi)
    self._host_count = 0
    self._departed: dict[int, dict[str, int]] = {}  # rank -> its counts when it left
    self._traces: dict[str, list] = {}  # step function name -> its last traced signature
    self._trace_note: str | None = None  # what the last re-trace changed
    self._last_probe = 0.0
    self._started = False
    self._stopping = threading.Event()
    self._threads: list[threading.Thread] = []
    self._main_thread = threading.main_thread().ident
    self.on_timeout = self._abort  # tests may replace it
    self.hosts: list[str] | None = None  # each rank's host, for reports (set by jdist.init)

  def start(self) -> None:
    if self._started or self.size < 2:
      return
    self._started = True
    self._threads = [threading.Thread(target=self._serve, name="jdist-watchdog", daemon=True),
                     threading.Thread(target=self._monitor_steps, name="jdist-step-monitor",
                                      daemon=True)]
    for thread in self._threads:
      thread.start()
    abort.install_excepthook(self.comm, self.rank)

  def shutdown(self) -> None:
    """Stops the watchdog at exit, after the steps already dispatched finish.

    Steps run asynchronously: when the script ends, its last steps may still
    be waiting for other ranks. They are awaited (still under the deadline),
    then both threads stop, so neither is inside JAX or MPI when Python and
    MPI finalize (a thread killed there aborts the process).
    """
    if not self._started or self._stopping.is_set():
      return
    self._steps.put(None)  # the monitor drains the queue, then ends
    self._threads[1].join()
    self._announce_departure()
    self._stopping.set()
    self._threads[0].join(timeout=10 * _POLL_S + 10)
    if self.size > 1 and not self._peers_departed(_LEAVING_ALONE_S):
      # This rank leaves while others still run: they will report it, and all
      # this one prints from now on is JAX's shutdown dying with the job.
      abort.silence_stderr()

  def _peers_departed(self, wait_s: float) -> bool:
    """Whether every peer announced its departure within `wait_s` (exit, threads stopped)."""
    mpi_status = self._mpi.Status()
    deadline = time.monotonic() + wait_s
    while len(self._departed) < self.size - 1 and time.monotonic() < deadline:
      while self.comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=_DEPART_TAG, status=mpi_status):
        counts = self.comm.recv(source=mpi_status.Get_source(), tag=_DEPART_TAG)
        self._departed[counts["rank"]] = counts
      time.sleep(0.01)
    return len(self._departed) >= self.size - 1

  @property
  def step(self) -> int:
    """Steps dispatched so far (the step a waiting rank is in is `step`)."""
    return self._dispatched

  @property
  def host_exchanges(self) -> int:
    """Host exchanges begun so far (the one a rank waits in included)."""
    return self._host_count

  def _new_wait(self, label: str, since: float, number: int, host: bool) -> _Wait:
    return _Wait(label, since, since + self.timeout, number=number, host=host)

  @contextlib.contextmanager
  def waiting(self, label: str):
    """Marks a host-side wait for other ranks, under the deadline."""
    with self._lock:
      self._host_count += 1
      wait = self._new_wait(label, time.monotonic(), self._host_count, host=True)
      self._host_waits.append(wait)
    entry = flight_recorder.host_posted(wait.number, label)
    try:
      yield
    finally:
      flight_recorder.host_done(entry)
      with self._lock:
        self._host_waits.remove(wait)
        self._last_activity = time.monotonic()

  def step_dispatched(self, marker, name: str | None = None) -> None:
    """Registers a dispatched compiled step.

    Args:
      marker: one of the step's outputs (ready when the step has finished).
      name: the stepped function's name; steps are then numbered per name
        ("step 5 of train_step"), else in one sequence ("compiled step 6").
    """
    with self._lock:
      self._dispatched += 1
      self._last_activity = time.monotonic()
      if name is None:
        label = f"compiled step {self._dispatched}"
      else:
        self._calls[name] = self._calls.get(name, 0) + 1
        label = f"step {self._calls[name]} of {name}"
      self._last_dispatched = label
      number, call = self._dispatched, self._calls.get(name or "", self._dispatched)
    flight_recorder.step_dispatched(number, name, time.monotonic_ns(), call)
    if self._started:
      self._steps.put((number, label, marker, time.monotonic()))

  def note_trace(self, name: str, args: Any) -> None:
    """Records that step function `name` is being traced for `args` (at trace time).

    A re-trace with other shapes or dtypes is remembered as a note ("x is now
    float32[15, 8] (was float32[16, 8])"), which a divergence report shows.
    """
    signature = trace_signature(args)
    with self._lock:
      previous = self._traces.get(name)
      self._traces[name] = signature
      if previous is None:
        self._trace_note = None
        return
      changed = [f"{path} is now {now} (was {before})"
                 for (path, now), (_, before) in zip(signature, previous) if now != before]
      if len(signature) != len(previous):
        changed.append(f"{len(signature)} array arguments (were {len(previous)})")
      self._trace_note = (f"it is tracing {name} again: " + "; ".join(changed[:3])
                          if changed else f"it is tracing {name} again")

  def _monitor_steps(self) -> None:
    while True:
      item = self._steps.get()
      if item is None:
        return
      number, label, marker, dispatched_at = item
      with self._lock:
        # A queued step only starts waiting once the one before it is done.
        self._step_wait = self._new_wait(label, max(dispatched_at, self._last_done), number,
                                         host=False)
      try:
        marker.block_until_ready()
      except Exception:  # pylint: disable=broad-except
        pass  # the step failed; its caller sees the error
      with self._lock:
        started, self._step_wait = self._step_wait.since, None
        self._completed = number
        self._last_completed = label
        self._last_done = self._last_activity = time.monotonic()
      flight_recorder.step_done(number, int(started * 1e9), int(self._last_done * 1e9))

  def _current_wait(self) -> _Wait | None:
    # Caller holds the lock. A host wait is what the main thread is in.
    return self._host_waits[-1] if self._host_waits else self._step_wait

  def status(self) -> dict[str, Any]:
    """Where this rank is, as reported to a rank that diagnoses a stall."""
    now = time.monotonic()
    frame = sys._current_frames().get(self._main_thread)  # pylint: disable=protected-access
    with self._lock:
      current = self._current_wait()
      return {
          "rank": self.rank,
          "dispatched": self._dispatched,
          "completed": self._completed,
          "last_dispatched": self._last_dispatched,
          "last_completed": self._last_completed,
          "waiting_in": current.label if current else None,
          "wait_number": current.number if current else 0,
          "host_wait": bool(current and current.host),
          "trace_note": self._trace_note,
          "waiting_s": now - current.since if current else 0.0,
          "idle_s": now - self._last_activity,
          # Blocked in a host exchange (even one made while tracing) is waiting.
          "compiling": (not self._host_waits and frame is not None
                        and in_jax_compiler(frame)),
          "where": user_location(frame) if frame is not None else None,
          "flight": flight_recorder.summary(),
      }

  def _overrun(self) -> _Wait | None:
    now = time.monotonic()
    with self._lock:
      for wait in self._host_waits + [self._step_wait]:
        if wait is not None and now > wait.deadline:
          return wait
    return None

  def _still_waiting(self, wait: _Wait) -> bool:
    with self._lock:
      return wait is self._step_wait or any(w is wait for w in self._host_waits)

  def _serve(self) -> None:
    failures = 0
    while not self._stopping.is_set():
      try:
        if self._serve_once():
          return
        failures = 0
      except Exception as err:  # pylint: disable=broad-except
        # A watchdog that dies silently protects nothing: say so, keep going.
        failures += 1
        if failures == 1:
          sys.stderr.write(f"jdist watchdog: rank {self.rank}: {type(err).__name__}: {err}\n")
      time.sleep(_POLL_S)

  def _announce_departure(self) -> None:
    """Tells every peer how far this rank got, as it exits (see module doc)."""
    counts = {"rank": self.rank, "steps": self._dispatched, "host": self._host_count,
              "flight": flight_recorder.summary()}
    sends = [self.comm.isend(counts, dest=peer, tag=_DEPART_TAG)
             for peer in range(self.size) if peer != self.rank]
    deadline = time.monotonic() + 2.0  # small messages; never hold up the exit
    while sends and time.monotonic() < deadline:
      sends = [r for r in sends if not r.Test()]
      time.sleep(0.01)
    self._peers.pending += sends

  def _departure_stall(self) -> str | None:
    """The report, if this rank waits where a departed rank never went."""
    mpi_status = self._mpi.Status()
    while self.comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=_DEPART_TAG, status=mpi_status):
      counts = self.comm.recv(source=mpi_status.Get_source(), tag=_DEPART_TAG)
      self._departed[counts["rank"]] = counts
    with self._lock:
      wait = self._current_wait()
      if not self._departed or wait is None:
        return None
      if time.monotonic() - wait.since < DEPARTURE_GRACE_S:
        return None
      gone = {rank: counts for rank, counts in self._departed.items()
              if wait.number > counts["host" if wait.host else "steps"]}
    if not gone:
      return None
    # The departed ranks' recorders came with their departure; ask the others.
    replies = self._query_peers() if len(gone) < self.size - 1 else {}
    replies.update({rank: counts for rank, counts in gone.items() if "flight" in counts})
    return self._with_flight(describe_departure(self.rank, wait.label, wait.number, wait.host,
                                                gone), replies)

  def _divergence(self) -> str | None:
    """The report, if this rank's wait and a peer's exclude each other (module doc)."""
    now = time.monotonic()
    with self._lock:
      wait = self._current_wait()
      if wait is None or now - wait.since < DIVERGENCE_GRACE_S:
        return None
      if now - self._last_probe < DIVERGENCE_GRACE_S:
        return None
      self._last_probe = now
    replies = self._query_peers()
    replies[self.rank] = self.status()
    found = find_divergence(replies, DIVERGENCE_GRACE_S)
    return self._with_flight(describe_divergence(self.rank, *found), replies) if found else None

  def _serve_once(self) -> bool:
    """Answers queries and checks the deadline; True once the job was aborted."""
    abort.quiet_if_told(self.comm, self._mpi)  # a peer reported and ends the job
    self._answer_queries()
    report = self._departure_stall() or self._divergence()
    if report is not None:
      self.on_timeout(report)
      return True
    while True:
      wait = self._overrun()
      if wait is None:
        return False
      replies = self._query_peers()
      if not self._still_waiting(wait):
        continue  # the peers arrived while we asked: no stall after all
      compiling = [r for r in sorted(replies) if replies[r].get("compiling")]
      stalled = [p for p in range(self.size) if p != self.rank and is_missing(replies.get(p))]
      if compiling and not stalled and wait.grace_s < self.compile_grace:
        # Compiling is work, not a stall: give the compiling peers another deadline.
        extension = min(self.timeout, self.compile_grace - wait.grace_s)
        with self._lock:
          wait.deadline = time.monotonic() + extension
          wait.grace_s += extension
        continue
      waited = time.monotonic() - wait.since
      self.on_timeout(self._with_flight(describe_stall(
          self.rank, self.size, wait.label, waited, self.timeout, replies, self.hosts), replies))
      return True

  def _with_flight(self, report: str, replies: dict[int, dict[str, Any]]) -> str:
    """`report` and the flight recorders' section (`flight_report.describe`)."""
    return flight_report.with_section(report, replies, self.rank, self.size)

  def _answer_queries(self) -> None:
    self._peers.answer(self.status)

  def _query_peers(self, final: bool = False) -> dict[int, dict[str, Any]]:
    """Every peer's `status()`; `final`: they run their abort hooks first."""
    return self._peers.query(self.status, min(5.0, max(1.0, self.timeout / 2)), final)

  def _abort(self, message: str) -> None:
    if flight_recorder.has_abort_hooks():  # e.g. jdist.timeline: every rank writes its part
      self._query_peers(final=True)
      flight_recorder.run_abort_hooks()
    abort.abort_job(self.comm, message, self.rank)
