"""Starting jdist: the world (runtime), then the collective layer's route.

`init()` is `jdist.init()`: the runtime discovers and starts the processes'
world (`jdist.runtime.topology.init_world`), and the route buffers take
across processes inside steps (`jdist.collectives.routes`) is chosen once,
here, and named in the returned `Topology`. `ensure_initialized()` is for
entry points that may run before the user's `jdist.init()` (the first call of
a `jdist.data_parallel` step); getters such as `jdist.get_topology()` start
nothing.
"""

from __future__ import annotations

import dataclasses

from jdist.collectives import routes
from jdist.runtime import jax_distributed as jax_distributed_lib
from jdist.runtime import topology as topology_lib

_route: routes.Route | None = None  # the started route, set once by init()


def _start_route(topology: topology_lib.Topology) -> topology_lib.Topology:
  global _route
  _route = routes.start(topology)
  return dataclasses.replace(topology, route=_route.name)


def init(*, timeout: float | None = None, backend: str | None = None,
         bind_gpu: bool | None = None,
         jax_distributed: bool | None = None) -> topology_lib.Topology:
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

  Returns:
    The `Topology` of this process; its `route` names how steps exchange
    buffers across processes.

  Raises:
    jdist.errors.MissingMPIError: launched by mpirun but mpi4py/mpi4jax are
      not installed.
    jdist.errors.InitOrderError: called after JAX started its backends where
      that cannot work (see docs/troubleshooting.md).
    jdist.errors.CoordinatorError: JAX's coordinator was not reached.
    ValueError: an unknown backend, a bad timeout, or a bad `JDIST_ROUTE`.
  """
  return topology_lib.init_world(timeout=timeout, backend=backend, bind_gpu=bind_gpu,
                                 jax_distributed=jax_distributed_lib.wanted(jax_distributed),
                                 finish=_start_route)


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
