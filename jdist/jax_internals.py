"""The only place jdist reaches into JAX's private modules (`jax._src`).

JAX has no public API for the two facts below; both are read here so that a
JAX release that moves them breaks one module with a clear message, and
pyproject.toml bounds `jax` to the range CI tests (`.ci/constraints.txt`).

- whether JAX has created its backends (XLA reads `XLA_FLAGS` and `NPROC`
  only then, so jdist must know whether changing them can still work);
- the trace being built (the callback route orders a step's exchanges per
  trace; see `jdist.collectives.transport`).
"""

from __future__ import annotations

from typing import Any

TESTED_JAX = ">=0.10.2,<0.11"


def _unsupported(what: str, err: Exception) -> RuntimeError:
  import jax  # pylint: disable=g-import-not-at-top
  return RuntimeError(
      f"jdist needs {what} from JAX's internals, which jax {jax.__version__} does not "
      f"provide ({type(err).__name__}: {err}). jdist is tested with jax{TESTED_JAX}: "
      f"install that range (bash scripts/install.sh pins it).")


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


def current_trace() -> Any:
  """The JAX trace now being built (an eval trace outside any transformation).

  Raises:
    RuntimeError: this JAX has no `trace_ctx`; names the tested range.
  """
  try:
    from jax._src import core  # pylint: disable=g-import-not-at-top
    return core.trace_ctx.trace
  except (ImportError, AttributeError) as err:
    raise _unsupported("the current trace (jax._src.core.trace_ctx)", err) from None
