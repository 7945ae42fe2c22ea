"""The only place jdist reaches into JAX's private modules (`jax._src`).

JAX has no public API for the fact below; it is read here so that a JAX
release that moves it breaks one module with a clear message, and
pyproject.toml bounds `jax` to the range CI tests (`.ci/constraints.txt`):
whether JAX has created its backends (XLA reads `XLA_FLAGS` and `NPROC` only
then, so jdist must know whether changing them can still work).

And the jit step being traced (`jit_trace`): jdist's reductions in a
`jax.jit` step over global arrays note which step their exchanges belong to,
so `jdist.timeline` can record that step (`jdist.runtime.jit_steps`).

And JAX's persistent compilation cache, which under JAX's distributed runtime
only process 0 writes (`cache_programs_on_every_process`): jdist's steps are
each process's own programs, which every other rank compiled again in each
job, a restarted one included.

(The callback route's exchange chain once read the current trace from here;
it now keys on the public `jax.extend.core.get_opaque_trace_state()`, and
the collective layer imports nothing private.)
"""

from __future__ import annotations

import threading
import warnings

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


# Which programs the compilation under way on this thread spans (see below).
_compiling = threading.local()


def cache_programs_on_every_process() -> bool:
  """Lets each process write its own programs to JAX's persistent cache.

  Under JAX's distributed runtime only process 0 writes cache entries (JAX
  assumes programs that span processes, compiled alike everywhere, and a
  shared cache directory: jax #18819). jdist compiles each process's step
  over its own devices, so every other rank's programs were never written,
  and a restarted job (or the next job on that rank) compiled them again:
  a second `jdist train` of 2 processes on one cache took 10.1 / 10.2 s
  before, 6.5 / 7.6 s with this (rank 1's 24 programs read, not compiled).
  Programs that span several processes keep JAX's rule. Only where a
  cache directory is set already (`JAX_COMPILATION_CACHE_DIR`, or
  `jax.config` before `jdist.init()`): without one, no jdist code runs in
  JAX's compilations.

  Returns:
    False where nothing changed: no cache directory is set, or this JAX keeps
    its cache elsewhere.
  """
  try:
    from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top
    from jax._src import compiler  # pylint: disable=g-import-not-at-top
    from jax._src import config  # pylint: disable=g-import-not-at-top
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  if not compilation_cache.is_persistent_cache_enabled():
    return False
  compile_and_write, cache_write = (getattr(compiler, "_compile_and_write_cache", None),
                                    getattr(compiler, "_cache_write", None))
  if compile_and_write is None or cache_write is None:
    return False
  if getattr(cache_write, "jdist", False):
    return True

  # JAX calls this on a cache miss: the devices tell whose program it is.
  def _compile_and_write_cache(backend, computation, executable_devices, *args, **kwargs):
    spans = {getattr(d, "process_index", 0) for d in executable_devices}
    _compiling.own = len(spans) == 1
    try:
      return compile_and_write(backend, computation, executable_devices, *args, **kwargs)
    finally:
      _compiling.own = False

  def _cache_write(cache_key, compile_time_secs, module_name, backend, executable,
                   host_callbacks):
    if (distributed.global_state.process_id == 0 or not getattr(_compiling, "own", False)
        or host_callbacks
        or compile_time_secs < config.persistent_cache_min_compile_time_secs.value):
      return cache_write(cache_key, compile_time_secs, module_name, backend, executable,
                         host_callbacks)
    try:
      compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend,
                                                int(compile_time_secs))
    except Exception as err:  # pylint: disable=broad-except
      warnings.warn(f"jdist: could not write {module_name!r} to JAX's compilation cache: "
                    f"{type(err).__name__}: {err}")
    return None

  _cache_write.jdist = True
  compiler._compile_and_write_cache = _compile_and_write_cache  # pylint: disable=protected-access
  compiler._cache_write = _cache_write  # pylint: disable=protected-access
  return True
