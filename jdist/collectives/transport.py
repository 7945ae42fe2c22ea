"""Moving 1-D buffers across every replica, inside a step: the route's primitives.

Three primitives, each over all replicas (local devices, then processes):
`sum_all` (full precision), `sum_all_16bit` (16-bit payload, float32
accumulation) and `gather_all` (replica-ordered all-gather). Each runs on a
route object (`jdist.collectives.routes`: "local", "mpi4jax", "native" or
"callback") that its caller passes explicitly, with the mapped axis of the
local devices: the route `jdist.init()` chose (`route_for(None)`), or for
measurements that compare routes in one job, another one by name
(`jdist.collectives.on_route`). No ambient state chooses a route.

Every call records the bytes this process sends across processes in the
active `measure()` ledger (see `jdist.collectives.wire`).
"""

from __future__ import annotations

import jax

from jdist.collectives import autodiff
from jdist.collectives import routes
from jdist.collectives import start
from jdist.collectives.routes import ROUTE_ENV, ROUTES  # pylint: disable=unused-import
from jdist.collectives.wire import DATA_AXIS, WireLedger, measure  # pylint: disable=unused-import


def route_for(name: str | None = None) -> routes.Route:
  """The route object named `name`; None: the one `jdist.init()` chose.

  Raises:
    ValueError: `name` is not a route this job can take.
  """
  return start.route_named(name)


def route() -> str:
  """How buffers cross processes in this job's steps: "local", "mpi4jax", "native"
  or "callback" (the route `jdist.init()` chose, for both kinds of step)."""
  return start.active_route().name


def sum_all(buffer: jax.Array, on: routes.Route, axis: str = DATA_AXIS) -> jax.Array:
  """Sum of a 1-D buffer over every replica on route `on`, in the buffer's dtype."""
  return on.sum_all(buffer, axis)


def sum_all_16bit(buffer: jax.Array, on: routes.Route, axis: str = DATA_AXIS) -> jax.Array:
  """Sum over every replica of a float16/bfloat16 buffer on route `on`.

  Every hop carries 16 bits per value; sums are accumulated in float32 and
  rounded once per hop. The caller pre-divides to keep sums in range.
  """
  return on.sum_all_16bit(buffer, axis)


def gather_all(buffer: jax.Array, on: routes.Route, axis: str = DATA_AXIS) -> jax.Array:
  """Every replica's 1-D buffer on route `on`, stacked in global replica order: [R, n]."""
  return on.gather_all(buffer, axis)


def join(buffers: list[jax.Array], on: routes.Route) -> list[jax.Array]:
  """Reduced buffers that the step reads only once all of them are reduced.

  Differentiable (the identity: tangents and cotangents pass unjoined).
  """
  if len(buffers) < 2:
    return list(buffers)
  return list(autodiff.join(on, tuple(buffers)))
