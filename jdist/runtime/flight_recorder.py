"""The flight recorder: this rank's last cross-process exchanges, always on.

Every exchange that crosses processes is recorded where it actually runs,
with its ordinal, call count, kind, bytes and state (posted, on the wire,
done), in a ring of the last `SLOTS`:

  * the native route: by the C++ engine itself (`native/flight.h`), when the
    first local device posts, when its MPI part starts and when it is done;
    read through a source the engine registers (`add_source`);
  * the callback route: by the host function each device runs
    (`device_posted` / `device_done`);
  * the mpi4jax route, where nothing of jdist runs on the host during a
    step: at trace level, each traced exchange of a step is recorded as
    posted when the step is dispatched and done when it ends (`step_*`);
  * host exchanges between steps (`jdist.barrier`, the structure checks...):
    by the watchdog's `waiting`, numbered by its host exchange count.

An exchange is named by its ordinal (its position in the step, the same on
every process; `jdist.collectives.routes.base`) and its call (how many times this
process ran that ordinal before), so the same exchange has the same name on
every rank. Host exchanges have kind "host" and their count as ordinal.

The watchdog's status replies carry `summary()`; `flight_report` finds the
first exchange the ranks disagree on. `jdist.timeline` listens to the steps
(`add_listener`) for its trace.

`JDIST_FLIGHT_RECORDER=0` (or `set_enabled(False)`) stops the Python side
recording, for the timeline A/B of its cost only (benchmarks/timeline_ab.py at commit
d7ea04b): an abort report then lacks those exchanges. The engine's C++ ring stays
on (a few stores).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import os
import sys
import threading
import time
from typing import Any, Callable

SLOTS = 256
ENABLE_ENV = "JDIST_FLIGHT_RECORDER"  # "0": Python side off (benchmark A/B only)
STATES = ("posted", "wire", "done")
_LABEL_LIMIT = 4096  # traced exchanges remembered for labels
_KIND_WORDS = {"sum": "dense sum", "sum16": "16-bit sum", "gather": "gather", "host": "host"}


@dataclasses.dataclass
class Entry:
  """One exchange in the recorder (times: `time.monotonic_ns()`, 0 if not yet)."""
  ordinal: int
  call: int
  kind: str  # "sum", "sum16", "gather" or "host"
  nbytes: int
  state: str  # one of STATES
  posted_ns: int
  wire_ns: int = 0
  done_ns: int = 0
  route: str = ""
  label: str = ""

  def key(self) -> tuple:
    return ("host", self.ordinal) if self.kind == "host" else ("step", self.ordinal, self.call)


class _Recorder:
  """The process-wide recorder state (module functions below use one)."""

  def __init__(self):
    self.lock = threading.Lock()
    self.ring: collections.deque[Entry] = collections.deque(maxlen=SLOTS)
    self.sources: list[Callable[[], list[Entry]]] = []
    self.labels: dict[tuple, str] = {}
    self.traced_steps: dict[str, list[tuple[int, str, int, str]]] = {}
    self.calls: dict[tuple, int] = {}
    self.open: dict[tuple, list] = {}  # callback exchanges in flight: [entry, devices left]
    self.step_entries: dict[int, list[Entry]] = {}
    self.listeners: list[Any] = []
    self.abort_hooks: list[Callable[[], None]] = []
    self.host_count = 0


_state = _Recorder()
_enabled = os.environ.get(ENABLE_ENV, "1") != "0"


def set_enabled(on: bool) -> bool:
  """Turns the Python side's recording on or off (benchmarks); returns the previous setting.

  Listeners (`jdist.timeline`) and abort hooks are served either way.
  """
  global _enabled
  previous, _enabled = _enabled, bool(on)
  return previous


def enabled() -> bool:
  return _enabled


def reset() -> None:
  """Forgets every entry and listener (tests); the sources (the engine) stay."""
  global _state
  sources = _state.sources
  _state = _Recorder()
  _state.sources = sources


def detach_sources() -> list[Callable[[], list[Entry]]]:
  """Removes and returns the sources, so `snapshot` sees only Python's ring (tests)."""
  sources, _state.sources = _state.sources, []
  return sources


def add_source(source: Callable[[], list[Entry]]) -> None:
  """Adds a reader of entries recorded elsewhere (the native engine's ring)."""
  if source not in _state.sources:
    _state.sources.append(source)


# The communication schemes tracing an exchange, outermost first (`scheme`).
_schemes: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "jdist_schemes", default=())


@contextlib.contextmanager
def scheme(name: str | None):
  """Names the exchanges traced inside after scheme `name` ("DiLoCo", "sparse").

  Transformations and payloads say what they are while they trace their
  exchanges; nested schemes read outermost first. None names nothing.
  """
  if not name:
    yield
    return
  token = _schemes.set(_schemes.get() + (name,))
  try:
    yield
  finally:
    _schemes.reset(token)


def scheme_label(kind: str) -> str:
  """'PowerSGD factors: dense sum': the schemes tracing the exchange, and its kind."""
  found = tuple(dict.fromkeys(_schemes.get()))  # each once, outermost first
  return f"{' / '.join(found) if found else 'psum/pmean'}: {_KIND_WORDS.get(kind, kind)}"


def note_traced(route: str, kind: str, ordinal: int, nbytes: int, step: str | None) -> None:
  """Records, at trace time, what exchange `ordinal` of step `step` carries."""
  label = scheme_label(kind)
  with _state.lock:
    if len(_state.labels) >= _LABEL_LIMIT:
      _state.labels.clear()
    _state.labels[(ordinal, kind, int(nbytes))] = label
    _state.labels[(ordinal, kind)] = label
    if route == "mpi4jax" and step is not None:  # nothing of jdist runs on the host there
      traced = _state.traced_steps.setdefault(step, [])
      traced[:] = [t for t in traced if t[0] != ordinal] + [(ordinal, kind, int(nbytes), label)]


def label_of(entry: Entry) -> str:
  if entry.label or entry.kind == "host":
    return entry.label
  labels = _state.labels
  return (labels.get((entry.ordinal, entry.kind, entry.nbytes))
          or labels.get((entry.ordinal, entry.kind)) or _KIND_WORDS.get(entry.kind, entry.kind))


def _next_call(key: tuple) -> int:
  call = _state.calls.get(key, 0)
  _state.calls[key] = call + 1
  return call


def device_posted(device: int, ordinal: int, kind: str, nbytes: int, devices: int,
                  route: str = "callback") -> tuple:
  """A local device enters exchange `ordinal` (a host function); returns its key."""
  if not _enabled:
    return ()
  now = time.monotonic_ns()
  with _state.lock:
    call = _next_call(("device", int(device), ordinal))
    key = (ordinal, call)
    slot = _state.open.get(key)
    if slot is None:
      entry = Entry(ordinal, call, kind, int(nbytes), "wire", now, wire_ns=now, route=route)
      _state.ring.append(entry)
      _state.open[key] = [entry, devices]
  return key


def device_done(key: tuple) -> None:
  """A local device leaves the exchange `device_posted` returned `key` for."""
  if not key:
    return
  with _state.lock:
    slot = _state.open.get(key)
    if slot is None:
      return
    slot[1] -= 1
    if slot[1] <= 0:
      slot[0].state, slot[0].done_ns = "done", time.monotonic_ns()
      del _state.open[key]


def host_posted(number: int, label: str) -> Entry:
  """Host exchange `number` (the watchdog's count) begins."""
  now = time.monotonic_ns()
  entry = Entry(number, 0, "host", 0, "wire", now, wire_ns=now, route="host", label=label)
  if not _enabled:
    return entry
  with _state.lock:
    _state.host_count = max(_state.host_count, number)
    _state.ring.append(entry)
  return entry


def host_done(entry: Entry) -> None:
  with _state.lock:  # `done_since` reads state and time together
    entry.state, entry.done_ns = "done", time.monotonic_ns()


def step_dispatched(number: int, name: str | None, at_ns: int, call: int | None = None) -> None:
  """Compiled step `number` (call `call` of function `name`) was dispatched (the watchdog)."""
  if not _enabled:
    for listener in list(_state.listeners):
      listener.step_dispatched(number, name, at_ns, number if call is None else call)
    return
  with _state.lock:
    traced = _state.traced_steps.get(name or "", ())
    entries = [Entry(ordinal, _next_call(("step", ordinal)), kind, nbytes, "posted", at_ns,
                     route="mpi4jax", label=label) for ordinal, kind, nbytes, label in traced]
    _state.ring.extend(entries)
    if entries:
      _state.step_entries[number] = entries
    listeners = list(_state.listeners)
  for listener in listeners:
    listener.step_dispatched(number, name, at_ns, number if call is None else call)


def step_done(number: int, start_ns: int, done_ns: int) -> None:
  """Compiled step `number` ended; it ran on the devices from `start_ns` (from the watchdog)."""
  if not _enabled:
    for listener in list(_state.listeners):
      listener.step_done(number, start_ns, done_ns)
    return
  with _state.lock:
    for entry in _state.step_entries.pop(number, ()):
      entry.state, entry.done_ns = "done", done_ns
    listeners = list(_state.listeners)
  for listener in listeners:
    listener.step_done(number, start_ns, done_ns)


def add_listener(listener: Any) -> None:
  """`listener.step_dispatched(number, name, ns, call)`, `.step_done(number, start, done)`."""
  with _state.lock:
    _state.listeners.append(listener)


def remove_listener(listener: Any) -> None:
  with _state.lock:
    if listener in _state.listeners:
      _state.listeners.remove(listener)


def on_abort(hook: Callable[[], None]) -> None:
  """Runs `hook()` before the watchdog aborts the job (jdist.timeline writes its file)."""
  _state.abort_hooks.append(hook)


def remove_on_abort(hook: Callable[[], None]) -> None:
  if hook in _state.abort_hooks:
    _state.abort_hooks.remove(hook)


def has_abort_hooks() -> bool:
  return bool(_state.abort_hooks)


def run_abort_hooks() -> None:
  """Runs the `on_abort` hooks; a failing one is reported, not raised."""
  for hook in list(_state.abort_hooks):
    try:
      hook()
    except Exception as err:  # pylint: disable=broad-except
      sys.stderr.write(f"jdist: while aborting: {type(err).__name__}: {err}\n")


def done_since(after_ns: int) -> list[Entry]:
  """Copies of the Python-recorded entries (callback, mpi4jax, host) done after `after_ns`.

  Taken under the lock, so the set is consistent: an entry done before one
  returned is returned too (or was done at or before `after_ns`). Reading the
  live entries instead can see a later exchange done and miss an earlier one
  that finished while the ring was read, and a cut-off at the later one's
  time then drops the earlier one for good.
  """
  with _state.lock:
    return [dataclasses.replace(entry) for entry in _state.ring
            if entry.state == "done" and entry.done_ns > after_ns]


def snapshot(limit: int = SLOTS) -> list[Entry]:
  """The newest `limit` exchanges of every source, oldest first, labelled."""
  entries: list[Entry] = []
  for source in list(_state.sources):
    try:
      entries.extend(source())
    except Exception:  # pylint: disable=broad-except
      continue  # a recorder must never be the reason a report is missing
  with _state.lock:
    entries.extend(dataclasses.replace(e) for e in _state.ring)
  entries.sort(key=lambda e: e.posted_ns)
  entries = entries[-limit:]
  for entry in entries:
    entry.label = label_of(entry)
  return entries


def summary(last: int = 24) -> dict[str, Any]:
  """What a status reply carries: the last entries, and how far each ordinal got.

  Returns:
    {"entries": [entry dicts, newest last, with "age_s"], "progress":
    {ordinal: highest call posted}, "host": host exchanges begun}.
  """
  now = time.monotonic_ns()
  entries = snapshot()
  progress: dict[int, int] = {}
  for entry in entries:
    if entry.kind != "host":
      progress[entry.ordinal] = max(progress.get(entry.ordinal, -1), entry.call)
  rows = []
  for entry in entries[-last:]:
    row = dataclasses.asdict(entry)
    row["age_s"] = (now - entry.posted_ns) / 1e9
    rows.append(row)
  return {"entries": rows, "progress": progress, "host": _state.host_count}
