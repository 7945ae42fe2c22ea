"""Starting jdist: the world (runtime), then the collective layer's route.

`init()` is `jdist.init()`: the runtime discovers and starts the processes'
world (`jdist.runtime.topology.init_world`), and the route buffers take
across processes inside steps (`jdist.collectives.routes`) is chosen once,
here, from `init(route=...)` (else `JDIST_ROUTE`, else automatically), and
named in the returned `Topology` (`route`, for both kinds of step).
Reductions read it through `active_route()`; nothing else changes it. `ensure_initialized()` is for
entry points that may run before the user's `jdist.init()` (the first call of
a `jdist.data_parallel` step); getters such as `jdist.get_topology()` start
nothing.
"""

from __future__ import annotations

import dataclasses
import os

from jdist.collectives import routes
from jdist.runtime import jax_distributed as jax_distributed_lib
from jdist.runtime import topology as topology_lib
from jdist.runtime import world as world_lib

_route: routes.Route | None = None  # the started route, set once by init()
_named: dict[str, routes.Route] = {}  # routes(name) objects, one per name (see `route_named`)


def _requested(route: str | None) -> tuple[str | None, str]:
  """The route asked for: `route`, else `JDIST_ROUTE`; and how errors name it."""
  if route is not None:
    return route, "jdist.init(route)"
  forced = os.environ.get(routes.ROUTE_ENV, "").strip()
  return (forced or None), routes.ROUTE_ENV


def _route_starter(route: str | None):
  name, source = _requested(route)

  def start_route(topology: topology_lib.Topology) -> topology_lib.Topology:
    global _route
    _route = routes.start(topology, name, source=source)
    return dataclasses.replace(topology, route=_route.name)
  return start_route


def init(*, timeout: float | None = None, backend: str | None = None,
         bind_gpu: bool | None = None, jax_distributed: bool | None = None,
         route: str | None = None) -> topology_lib.Topology:
  """Sets up the data-parallel world and returns this process's `Topology`.

  Idempotent: later calls return the first call's object (arguments of later
  calls must agree with it or be left out).

  Args:
    timeout: seconds a cross-process exchange may wait before the watchdog
      aborts the job, naming the missing ranks. Default: the `JDIST_TIMEOUT`
      environment variable, else 300.
    backend: "mpi" (default under mpirun: mpi4py/mpi4jax), "jax" (JAX's own
      multi-process collectives, via `jax.distributed.initialize`), or "none"
      (one process). Default: "mpi" when launched by an MPI launcher with
      more than one process, else "none".
    bind_gpu: under mpirun on GPUs, bind GPU `local_rank` to this process
      (SINGA's `rank_in_local`). Default: True when several processes share
      a node and CUDA_VISIBLE_DEVICES is unset.
    jax_distributed: under mpirun with backend "mpi", also start JAX's
      distributed runtime, so that `jax.process_index()` and
      `jax.process_count()` are the MPI rank and size (orbax, grain and
      `jax.experimental.multihost_utils` rely on them); jdist's exchanges do
      not change. Default: the `JDIST_JAX_DISTRIBUTED` environment variable
      ("0" turns it off), else True. Backend "jax" always starts it.
    route: how reductions cross processes inside steps, in
      `jdist.data_parallel` steps and jit steps over global arrays alike:
      "native" (jdist's C++ engine; the default wherever it is built),
      "mpi4jax" (one device per process), "callback" (host callbacks
      running mpi4py) or "local" (one process, or backend "jax"). Default:
      the `JDIST_ROUTE` environment variable, else the automatic choice
      (see `jdist.collectives.routes.select`).

  Returns:
    The `Topology` of this process; its `route` names how steps exchange
    buffers across processes.

  Raises:
    jdist.errors.MissingMPIError: launched by mpirun but mpi4py/mpi4jax are
      not installed.
    jdist.errors.InitOrderError: called after JAX started its backends where
      that cannot work (see docs/troubleshooting.md).
    jdist.errors.CoordinatorError: JAX's coordinator was not reached.
    ValueError: an unknown backend or a bad timeout; an unknown route, or
      one this job cannot take (the message names the allowed routes and
      why: "native" where its library is not built, "mpi4jax" with several
      devices per process, a cross-process route in one process); a route
      that disagrees with the first call's.
  """
  if route is not None and not isinstance(route, str):
    raise ValueError(f"jdist.init(route={route!r}): give a route name, one of "
                     f"{', '.join(routes.ROUTES)}, or None.")
  if route is not None and topology_lib.is_initialized():
    if route != topology_lib.current().route:
      raise ValueError(f"jdist.init(route={route!r}) after jdist was initialized with "
                       f"route={topology_lib.current().route!r}; call init once, first.")
  return topology_lib.init_world(timeout=timeout, backend=backend, bind_gpu=bind_gpu,
                                 jax_distributed=jax_distributed_lib.wanted(jax_distributed),
                                 finish=_route_starter(route))


def ensure_initialized() -> topology_lib.Topology:
  """The job's `Topology`, initializing jdist with defaults if nothing has."""
  return topology_lib.current() if topology_lib.is_initialized() else init()


def active_route() -> routes.Route:
  """The route `init()` started; before it, a single process's local route.

  Raises:
    jdist.errors.JdistError: not initialized under an MPI launcher.
  """
  if _route is not None:
    return _route
  topology = topology_lib.current()  # raises under mpirun before jdist.init()
  if topology.process_count > 1 and topology.backend != "jax":
    raise RuntimeError(f"{topology} was initialized without its route: start jdist with "
                       f"jdist.init(), not jdist.runtime.topology.init_world().")
  return routes.LocalRoute(topology)


def route() -> str:
  """How buffers cross processes in this job's steps: "local", "mpi4jax", "native"
  or "callback" (the route `jdist.init()` chose, for both kinds of step)."""
  return active_route().name


def route_named(name: str | None) -> routes.Route:
  """The route `name` of this job (the started one for None), one object per name.

  For measurements and tests that compare routes in one job
  (`jdist.collectives.on_route`); every process must ask for the same.

  Raises:
    ValueError: as `jdist.init(route=name)` would, for a route this job
      cannot take.
  """
  started = active_route()
  if name is None or name == started.name:
    return started
  if name not in _named:
    _named[name] = routes.select(topology_lib.current(), name)
  return _named[name]
