"""`jax.jit` steps over global arrays, as jdist sees them: the exchanges each runs.

A jit step is the user's own `jax.jit` function: jdist neither wraps nor
dispatches it, so the watchdog never hears of it. What jdist does see is
each of its reductions being traced (`jdist.collectives.context.per_process`):
they note here which exchanges (ordinals) the step being traced runs, and
under which function name. Every call of the compiled step then runs each
of those ordinals once, so `jdist.timeline` can tell a step's exchanges
apart as the engine reports them, and a step is over on this rank once all
of them are done. Exchanges traced in a `lax.cond` branch or a loop body
(local SGD's and DiLoCo's periodic averaging) may run not at all or several
times per call: they are the step's `extra` ordinals, filed by time.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

from jdist.runtime import jax_internals


@dataclasses.dataclass
class JitStep:
  """One traced jit step: its function's name and the ordinals of its exchanges."""
  key: int
  name: str
  ordinals: set = dataclasses.field(default_factory=set)  # run once per call
  extra: set = dataclasses.field(default_factory=set)  # under control flow


_lock = threading.Lock()
_by_trace: "weakref.WeakKeyDictionary[object, JitStep]" = weakref.WeakKeyDictionary()
_by_ordinal: dict[int, JitStep] = {}
_names: set[str] = set()
_count = 0


def note_exchanges(ordinals: list[int]) -> None:
  """At trace time: the jit step being traced runs exchanges `ordinals`."""
  global _count
  trace, name, nested = jax_internals.jit_trace()
  if trace is None:
    return
  with _lock:
    if not ordinals:  # nothing crosses processes (one process): named, never recorded
      _names.add(name)
      return
    step = _by_trace.get(trace)
    if step is None:
      _count += 1
      step = _by_trace[trace] = JitStep(_count, name)
      _names.add(name)
    (step.extra if nested else step.ordinals).update(ordinals)
    for ordinal in ordinals:
      _by_ordinal[ordinal] = step


def step_of(ordinal: int) -> JitStep | None:
  """The traced jit step that runs exchange `ordinal`, or None (not a jit step's)."""
  return _by_ordinal.get(ordinal)


def any_traced() -> bool:
  return bool(_by_ordinal)


def traced_names() -> set[str]:
  """Names of the jit steps traced so far with jdist exchanges in them."""
  with _lock:
    return set(_names)
