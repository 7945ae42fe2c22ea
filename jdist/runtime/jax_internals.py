"""The only place jdist reaches into JAX's private modules (`jax._src`).

JAX has no public API for the fact below; it is read here so that a JAX
release that moves it breaks one module with a clear message, and
pyproject.toml bounds `jax` to the range CI tests (`.ci/constraints.txt`):
whether JAX has created its backends (XLA reads `XLA_FLAGS` and `NPROC` only
then, so jdist must know whether changing them can still work).

And the jit step being traced (`jit_trace`): jdist's reductions in a
`jax.jit` step over global arrays note which step their exchanges belong to,
so `jdist.timeline` can record that step (`jdist.runtime.jit_steps`).

(The callback route's exchange chain once read the current trace from here;
it now keys on the public `jax.extend.core.get_opaque_trace_state()`, and
the collective layer imports nothing private.)
"""

from __future__ import annotations

TESTED_JAX = ">=0.10.2,<0.11"


def backends_initialized() -> bool:
  """True once JAX has created its backends (devices exist, flags are read)."""
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  probe = getattr(xla_bridge, "backends_are_initialized", None)
  if probe is not None:
    return bool(probe())
  return bool(getattr(xla_bridge, "_backends", None))


def jit_trace() -> tuple[object | None, str | None, bool]:
  """The outermost `jax.jit` trace active now, its function's name, and nesting.

  Returns:
    (the trace object, the traced function's name, whether a staged
    control-flow body sits inside it: a `lax.cond` branch or a loop body,
    whose exchanges may run not at all or several times per call), or
    (None, None, False) outside a jit trace or where JAX keeps its traces
    elsewhere.
  """
  try:
    from jax._src import core  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None, None, False
  trace = getattr(getattr(core, "trace_ctx", None), "trace", None)
  found = []
  while trace is not None:
    if type(trace).__name__ == "DynamicJaxprTrace":
      found.append(trace)
    trace = getattr(trace, "parent_trace", None)
  if not found:
    return None, None, False
  info = getattr(getattr(found[-1], "frame", None), "debug_info", None)
  return found[-1], getattr(info, "func_name", None) or "jit step", len(found) > 1
