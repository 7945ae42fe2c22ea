"""`jdist.timeline(path, steps=...)`: a Chrome / Perfetto trace of every rank.

While a timeline records, each rank keeps a bounded ring of records: every
compiled step (when it ran on the devices, from the watchdog's step monitor)
and every cross-process exchange in the window (from the native engine's
exchange trace, or the flight recorder on the other routes), and, where the
loop calls `observe`, each step's compression ratio and error-feedback
residual norm (`jdist.tracing.counters`). At `close()`
(the end of a `with` block, or of `jdist train --timeline`) rank 0 gathers
the rings over the host exchange and writes one file: ranks on several
nodes need no shared filesystem, and nothing is written during the steps.
`jdist timeline summarize FILE` reads it (docs/timeline.md).

The file is valid JSON however the run ends: written through a temporary
file and a rename; on SIGINT/SIGTERM or a watchdog abort, where no collective
can run, every rank writes its own part (rank 0 to `path`, rank r to
`path.rank<r>.json`), which `jdist timeline summarize` merges.
"""

from __future__ import annotations

import atexit
import collections
import signal
import socket
import threading
import time
import warnings
from typing import Any

from jdist.runtime import jit_steps
from jdist.tracing import counters as timeline_counters
from jdist.tracing import chrome_trace as timeline_format
from jdist.collectives import native
from jdist.runtime import flight_recorder
from jdist.runtime import host
from jdist.runtime import job as job_lib

DEFAULT_MAX_RECORDS = 20_000  # per rank: a few MB of JSON (docs/timeline.md)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_ROWS_PER_TAKE = 512
_DRAIN_S = 30.0  # longest wait at close() for the window's dispatched steps to be reported
_PENDING_COUNTERS = 64  # dispatched counters not yet read; beyond, observe() waits for the oldest
_JIT_POLL_S = 0.25  # how often jit steps' exchanges are collected (jdist.runtime.jit_steps)
_JIT_OPEN_LIMIT = 64  # jit steps' calls waiting for their other exchanges
_JIT_QUIET_S = 0.6  # at close(): no new exchange for this long, the jit steps are over


JIT_NUMBERS = 1 << 40  # jit steps' numbers in the ring: apart from the watchdog's


def parse_steps(text: str | None) -> tuple[int | None, int | None] | None:
  """'A:B' -> (A, B): steps A <= step < B (1-based; either side may be empty).

  Raises:
    ValueError: not of that form, or B <= A.
  """
  if text in (None, ""):
    return None
  first, sep, last = str(text).partition(":")
  try:
    window = (int(first) if first else None, int(last) if last else None)
  except ValueError:
    window = None
  if not sep or window is None or (None not in window and window[1] <= window[0]):
    raise ValueError(f"--timeline-steps {text!r}: use A:B (steps A to B-1; A: or :B too)")
  return window


class Timeline:
  """Records this rank's steps and exchanges; `close()` writes the merged trace.

  Args:
    path: the trace file (JSON, Chrome "traceEvents" format).
    steps: (first, end) step numbers to record (1-based, `end` excluded;
      None on either side: unbounded), or None for every step.
    max_records: the ring's size per rank (older records are dropped).
    function: count the window in steps of this step function only (e.g.
      "train_step"); other steps are recorded while the window is open.
  """

  def __init__(self, path: str, steps: tuple[int | None, int | None] | None = None,
               max_records: int = DEFAULT_MAX_RECORDS, function: str | None = None):
    self.path = str(path)
    self.window = steps or (None, None)
    self.function = function
    self._open = False
    self.records: collections.deque = collections.deque(maxlen=max_records)
    self.dropped = 0
    self._lock = threading.Lock()
    self._recording = False
    self._closed = False
    self._seen_ns = 0  # newest flight-recorder entry already taken
    self._native_was_on = False
    self._previous_handlers: dict[int, Any] = {}
    self._names: dict[int, str] = {}
    self._last_recorded: int | None = None  # the newest dispatched step, if recorded
    self._pending: collections.deque = collections.deque()  # (step, counters handle)
    self._pending_lock = threading.Lock()  # the main thread, and an abort's writer
    self._fetch_lock = threading.Lock()  # the step monitor and the jit poller take rows
    self._loose: list[tuple] = []  # exchanges of no jit step, for the next watchdog step
    self._jit_open: dict[tuple[int, int], list[tuple]] = {}  # (step key, call) -> exchanges
    self._jit_extra: list[tuple] = []  # exchanges under control flow, not yet filed
    self._jit_count = 0  # jit steps completed on this rank
    self._jit_calls: dict[str, int] = {}
    self._jit_last_end = 0
    self._jit_rows_at = 0.0  # when the poller last saw an exchange
    self._steps_recorded = 0
    self._poller: threading.Thread | None = None
    self._stopped = threading.Event()
    self.rank = job_lib.current().process_index
    self._counters = timeline_counters.Dispatcher(
        max(1, job_lib.current().process_count))

  # -- recording -------------------------------------------------------------

  def in_window(self, number: int) -> bool:
    number = number - JIT_NUMBERS if number > JIT_NUMBERS else number  # a jit step's count
    first, end = self.window
    return (first is None or number >= first) and (end is None or number < end)

  def start(self) -> "Timeline":
    self._native_was_on = native.enable_trace(True)
    native.take_trace()  # forget rows from before the timeline
    self._seen_ns = time.monotonic_ns()
    flight_recorder.add_listener(self)
    flight_recorder.on_abort(self.write_part)
    for sig in _SIGNALS:
      try:
        self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
      except ValueError:  # not the main thread: no handlers, the abort path remains
        break
    atexit.register(self._at_exit)
    self._recording = True
    self._poller = threading.Thread(target=self._poll_jit_steps, name="jdist-timeline-jit",
                                    daemon=True)
    self._poller.start()
    return self

  def step_dispatched(self, number: int, name: str | None, at_ns: int, call: int) -> None:
    """Decides whether step `number` is recorded (it is, when it ends, with its times)."""
    del at_ns
    if self.function is None:
      record = self.in_window(number)
    else:  # the window counts `function`'s steps; other steps while it is open
      if name == self.function:
        self._open = self.in_window(call)
      record = self._open
    if self._recording and record:
      self._names[number] = name or ""
    self._last_recorded = number if self._recording and record else None

  def observe(self, opt_state: Any, params: Any) -> None:
    """Counts the compression ratio and residual norm of the step just dispatched.

    Call it right after a recorded training step (`jdist train --timeline`
    does), with the step's new optimizer state and parameters (leading local
    device axis). A no-op for a step outside the window. The counters are
    computed on the devices and read once ready: the host does not wait.
    """
    number, self._last_recorded = self._last_recorded, None
    if number is None or not self._recording:
      return
    self._take_counters(wait=len(self._pending) >= _PENDING_COUNTERS)
    handle = self._counters.dispatch(opt_state, params)
    if handle is not None:
      self._pending.append((number, handle))

  def _take_counters(self, wait: bool, lock_timeout: float = -1) -> None:
    """Moves the counters that are ready into the ring (first the oldest, ready or not, if `wait`).

    An abort's writer gives up after `lock_timeout` s: the main thread may be
    the one waiting, for a device that will not finish.
    """
    if not self._pending_lock.acquire(timeout=lock_timeout):
      return
    try:
      while self._pending and (wait or self._counters.ready(self._pending[0][1])):
        number, handle = self._pending.popleft()
        counters = self._counters.read(handle)
        if counters is not None:
          with self._lock:
            self._append(("c", number, *counters))
        wait = False
    finally:
      self._pending_lock.release()

  def step_done(self, number: int, start_ns: int, done_ns: int) -> None:
    """From the watchdog's step monitor: the step ran from `start_ns` to `done_ns`."""
    exchanges = self._take_exchanges()  # those that ended since the last step ended
    name = self._names.pop(number, None)
    if not self._recording or name is None:
      return
    with self._lock:
      self._steps_recorded += 1
      self._append(("step", number, name, start_ns, done_ns))
      for record in exchanges:
        self._append(record)

  # -- jit steps (jdist.runtime.jit_steps) ---------------------------------

  def _poll_jit_steps(self) -> None:
    """The poller thread: assembles jit steps from their exchanges while recording."""
    while not self._stopped.wait(_JIT_POLL_S):
      if jit_steps.any_traced():
        self._take_exchanges(loose=False)

  def _jit_exchange(self, record: tuple) -> bool:
    """Files a jit step's exchange; records the step once all of its are in. False: not a jit step's."""
    step = jit_steps.step_of(record[1])
    if step is None:
      return False
    if record[1] in step.extra:  # under control flow: the step running when it was posted
      self._jit_extra.append(record)
      return True
    key = (step.key, record[2])  # the step, and how many times this rank ran it before
    found = self._jit_open.setdefault(key, [])
    found.append(record)
    if len({r[1] for r in found}) < len(step.ordinals):
      return True
    del self._jit_open[key]
    while len(self._jit_open) > _JIT_OPEN_LIMIT:  # calls that will never complete
      del self._jit_open[next(iter(self._jit_open))]
    done = max(r[9] for r in found)
    found += [r for r in self._jit_extra if r[6] <= done]
    self._jit_extra = [r for r in self._jit_extra if r[6] > done]
    self._jit_count += 1
    self._jit_calls[step.name] = call = self._jit_calls.get(step.name, 0) + 1
    first = min(r[6] for r in found)
    done = max(r[9] for r in found)
    # Its devices started it when the previous step ended, unless they were idle.
    start = self._jit_last_end if 0 < self._jit_last_end <= first else first
    self._jit_last_end = done
    number, last = JIT_NUMBERS + self._jit_count, self._last_recorded
    self.step_dispatched(number, step.name, start, call)
    self._last_recorded = last  # observe() counts the main thread's steps only
    if self._recording and self._names.pop(number, None) is not None:
      with self._lock:
        self._steps_recorded += 1
        self._append(("step", self._jit_count, step.name, start, done))
        for record in sorted(found, key=lambda r: r[6]):
          self._append(record)
    return True

  def _drain_jit_steps(self) -> None:
    """At close(): waits (bounded) until the jit steps' exchanges stop arriving."""
    if not jit_steps.any_traced():
      return
    deadline = time.monotonic() + _DRAIN_S
    self._jit_rows_at = time.monotonic()
    while time.monotonic() < deadline:
      self._take_exchanges(loose=False)
      quiet = time.monotonic() - self._jit_rows_at
      # A call begun before start() never completes: give up on it after a while.
      if quiet > _JIT_QUIET_S and (not self._jit_open or quiet > 10 * _JIT_QUIET_S):
        return
      time.sleep(_JIT_POLL_S / 5)

  def _why_nothing(self) -> str | None:
    """Why no step was recorded, where a jit step ran (close()'s warning), else None."""
    if self._steps_recorded:
      return None
    traced = jit_steps.traced_names()
    topo = job_lib.current()
    if self.function is not None and self.function not in traced:
      return (f"no step of {self.function} was recorded: it is not a jdist.data_parallel step, "
              f"and no jax.jit step of that name ran a jdist exchange (jdist.pmean, "
              f"jdist.dist_opt's update...) traced while this process ran; jdist records a "
              f"jax.jit step through the exchanges inside it (traced: "
              f"{sorted(traced) or 'none'}).")
    if not traced:
      return None
    if topo.process_count < 2:
      return (f"jax.jit steps ({', '.join(sorted(traced))}) are recorded through their "
              f"cross-process exchanges, and this job has one process: nothing crosses "
              f"processes, so no step was recorded.")
    return (f"no jax.jit step ({', '.join(sorted(traced))}) was recorded: jdist sees a jit "
            f"step's run only through the exchanges its engine reports (route "
            f"{topo.route!r}); the native and callback routes report them, mpi4jax's does not "
            f"(jdist.init(route='native')).")

  def _append(self, record: tuple) -> None:
    if len(self.records) == self.records.maxlen:
      self.dropped += 1
    self.records.append(record)

  def _take_exchanges(self, loose: bool = True) -> list[tuple]:
    """Exchanges finished since the last call that no jit step ran (`loose`: returned, else kept).

    Nothing once stopped: the engine's rows are the process's, and the poller
    or a late step monitor call would take the next timeline's.
    """
    with self._fetch_lock:
      if self._stopped.is_set():
        return []
      fresh = self._fetch_exchanges()
      if fresh:
        self._jit_rows_at = time.monotonic()
      self._loose.extend(r for r in fresh if not self._jit_exchange(r))
      if not loose:
        return []
      out, self._loose = self._loose, []
      return out

  def _fetch_exchanges(self) -> list[tuple]:
    """Exchanges finished since the last call: the engine's rows, then the recorder's."""
    out = []
    devices = max(1, job_lib.current().local_device_count)
    processes = max(1, job_lib.current().process_count)
    rows = []
    while True:  # a small buffer each time: this runs every step
      more = native.take_trace(_ROWS_PER_TAKE)
      rows.extend(more)
      if len(more) < _ROWS_PER_TAKE:
        break
    for row in rows:
      ordinal, call, kind, nbytes, first, last, wire, done = (int(v) for v in row)
      kind_name = ("sum", "sum16", "gather")[kind]
      if kind_name == "gather":  # the engine counts the gathered result
        nbytes //= devices * processes
      entry = flight_recorder.Entry(ordinal, call, kind_name, nbytes, "done", first)
      out.append(("x", ordinal, call, kind_name, flight_recorder.label_of(entry), nbytes,
                  first, last, wire, done, "native"))
    for entry in flight_recorder.done_since(self._seen_ns):
      if entry.route != "host":
        out.append(("x", entry.ordinal, entry.call, entry.kind, flight_recorder.label_of(entry),
                    entry.nbytes, entry.posted_ns, entry.posted_ns,
                    entry.wire_ns or entry.posted_ns, entry.done_ns, entry.route))
        self._seen_ns = max(self._seen_ns, entry.done_ns)
    return out

  def stop(self) -> None:
    if not self._recording:
      return
    self._recording = False
    self._stopped.set()
    # A take under way ends before the next timeline can start. Bounded: a
    # signal's handler may run on a thread that holds the lock.
    if self._fetch_lock.acquire(timeout=1.0):
      self._fetch_lock.release()
    if self._poller is not None and self._poller is not threading.current_thread():
      self._poller.join(timeout=1.0)
    flight_recorder.remove_listener(self)
    native.enable_trace(self._native_was_on)

  # -- writing ---------------------------------------------------------------

  def part(self) -> dict[str, Any]:
    """This rank's records, as `timeline_format.chrome_trace` takes them."""
    with self._lock:
      records = list(self.records)
    return {"steps": [r for r in records if r[0] == "step"],
            "exchanges": [r for r in records if r[0] == "x"],
            "counters": [r for r in records if r[0] == "c"],
            "wall_minus_mono_ns": time.time_ns() - time.monotonic_ns(),
            "host": socket.gethostname(), "dropped": self.dropped}

  def close(self) -> str | None:
    """Stops recording; gathers every rank's part to rank 0, which writes `path`.

    Collective: every process calls it (a `with` block's end does). Returns
    the path written on rank 0, else None.
    """
    if self._closed:
      return None
    # The steps dispatched in the window end on the devices; the watchdog's
    # monitor reports them a moment later.
    deadline = time.monotonic() + _DRAIN_S
    while self._names and time.monotonic() < deadline:
      time.sleep(0.005)
    while self._pending:  # the last steps' counters (their steps are done)
      self._take_counters(wait=True)
    self._drain_jit_steps()
    why = self._why_nothing()
    if why is not None:
      warnings.warn(f"jdist.timeline({self.path!r}): {why}", stacklevel=3)
    self.stop()
    parts = host.allgather_object(self.part(), "jdist.timeline (gathering the trace)")
    self._closed = True
    self._uninstall()
    if self.rank != 0:
      return None
    timeline_format.write_atomically(
        self.path, timeline_format.chrome_trace(dict(enumerate(parts))))
    return self.path

  def part_path(self) -> str:
    return self.path if self.rank == 0 else f"{self.path}.rank{self.rank}.json"

  def write_part(self) -> None:
    """Writes this rank's own records (no collective): the abort and signal path."""
    if self._closed:
      return
    self._closed = True
    self.stop()
    self._take_counters(wait=False, lock_timeout=1.0)  # a stalled device may never finish
    timeline_format.write_atomically(
        self.part_path(), timeline_format.chrome_trace({self.rank: self.part()}, complete=False))

  def _on_signal(self, signum, frame):
    self.write_part()
    previous = self._previous_handlers.get(signum)
    self._uninstall()
    if callable(previous):
      previous(signum, frame)
    elif previous == signal.SIG_DFL:
      signal.raise_signal(signum)

  def _at_exit(self) -> None:
    if not self._closed:  # never closed (an exception left the with block on one rank)
      self.write_part()

  def _uninstall(self) -> None:
    flight_recorder.remove_on_abort(self.write_part)
    for sig, previous in self._previous_handlers.items():
      try:
        if signal.getsignal(sig) == self._on_signal:
          signal.signal(sig, previous)
      except (ValueError, TypeError):
        pass
    self._previous_handlers.clear()

  def __enter__(self) -> "Timeline":
    return self

  def __exit__(self, kind, value, traceback) -> None:
    if kind is None:
      self.close()
    else:
      self.write_part()  # an exception may be on this rank only: no collective


def timeline(path: str, steps: str | tuple[int | None, int | None] | None = None,
             max_records: int = DEFAULT_MAX_RECORDS, function: str | None = None) -> Timeline:
  """Starts recording a timeline of every rank into `path` (Chrome / Perfetto JSON).

  Use it as a context manager around the training loop (every process
  alike); its end writes the merged trace on rank 0:

      with jdist.timeline("trace.json", steps="100:200"):
        for batch in loader:
          state = train_step(state, batch)

  Open the file in https://ui.perfetto.dev or chrome://tracing, or run
  `jdist timeline summarize trace.json`. See docs/timeline.md.

  Args:
    path: the file rank 0 writes.
    steps: the window of steps to record: "A:B" or (A, B), steps A to B-1
      counted from 1 as the watchdog counts dispatched steps; None: all.
    max_records: records kept per rank (a ring: the newest are kept).
    function: the name of the step function whose steps `steps` counts
      (others are recorded while the window is open); None: every
      `jdist.data_parallel` step counts.

  Returns:
    The started `Timeline` (`close()` it if not used in a `with` block).
  """
  window = parse_steps(steps) if isinstance(steps, str) or steps is None else tuple(steps)
  return Timeline(path, window, max_records, function).start()
