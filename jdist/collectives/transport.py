"""Moving 1-D buffers across every replica, inside a pmapped step.

Three primitives, each over all replicas (local devices, then processes):
`sum_all` (full precision), `sum_all_16bit` (16-bit payload, float32
accumulation) and `gather_all` (replica-ordered all-gather). Each runs on the
route `jdist.init()` started (`jdist.collectives.routes`: "local",
"mpi4jax", "native" or "callback"), with two explicit overrides:
`global_step_exchange()` (a global jit step's reductions) and
`forced_route(name)` (benchmarks comparing routes in one job).

Every call records the bytes this process sends across processes in the
active `measure()` ledger (see `jdist.collectives.wire`).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

from jdist.collectives import autodiff
from jdist.collectives import routes
from jdist.collectives import start
from jdist.collectives.routes import ROUTE_ENV, ROUTES  # pylint: disable=unused-import
from jdist.collectives.wire import DATA_AXIS, WireLedger, measure  # pylint: disable=unused-import
from jdist.runtime import topology as topology_lib

# Set while a global (jit) step's reduction is traced (see `context.per_process`).
# Such steps are dispatched by the user's own jax.jit, with no bound on the
# executions in flight; the native engine names an exchange by its ordinal and
# a per-device call count, which assumes a device runs one execution of a step
# at a time. Measured: the jit quickstart in 2x2 hung or aborted in 3 of 3 runs
# on the native route and passed on the callback route, so these take it
# (`Route.global_step_route`).
_global_step_exchange: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jdist_global_step_exchange", default=False)

_forced: contextvars.ContextVar[routes.Route | None] = contextvars.ContextVar(
    "jdist_forced_route", default=None)


@contextlib.contextmanager
def global_step_exchange():
  """Marks the reductions traced inside as a global (jit) step's."""
  token = _global_step_exchange.set(True)
  try:
    yield
  finally:
    _global_step_exchange.reset(token)


@contextlib.contextmanager
def forced_route(name: str):
  """Traces the collectives inside on route `name` ("native" or "callback").

  For benchmarks that compare routes in one job; `JDIST_ROUTE` does the
  same for a whole job.

  Raises:
    ValueError: as `JDIST_ROUTE` does for an unknown or unavailable route.
  """
  token = _forced.set(routes.select(topology_lib.current(), name))
  try:
    yield
  finally:
    _forced.reset(token)


def active() -> routes.Route:
  """The route the collectives traced here take."""
  forced = _forced.get()
  if forced is not None:
    return forced
  route = start.active_route()
  return route.global_step_route if _global_step_exchange.get() else route


def route() -> str:
  """How buffers cross processes here: "local", "mpi4jax", "native" or "callback"."""
  return active().name


def sum_all(buffer: jax.Array) -> jax.Array:
  """Sum of a 1-D buffer over every replica, in the buffer's dtype."""
  return active().sum_all(buffer)


def sum_all_16bit(buffer: jax.Array) -> jax.Array:
  """Sum over every replica of a float16/bfloat16 buffer.

  Every hop carries 16 bits per value; sums are accumulated in float32 and
  rounded once per hop. The caller pre-divides to keep sums in range.
  """
  return active().sum_all_16bit(buffer)


def gather_all(buffer: jax.Array) -> jax.Array:
  """Every replica's 1-D buffer, stacked in global replica order: [R, n]."""
  return active().gather_all(buffer)


def join(buffers: list[jax.Array]) -> list[jax.Array]:
  """Reduced buffers that the step reads only once all of them are reduced.

  Differentiable (the identity: tangents and cotangents pass unjoined).
  """
  if len(buffers) < 2:
    return list(buffers)
  return list(autodiff.join(active(), tuple(buffers)))
