"""Routes: how 1-D buffers cross every replica inside a step, one object each.

Every route offers three primitives over all replicas (local devices, then
processes): `sum_all` (full precision), `sum_all_16bit` (16-bit payload,
float32 accumulation) and `gather_all` (replica-ordered all-gather), and
records the bytes they send across processes (`base.measure`). A route
that crosses processes runs each exchange as the lowering of one JAX
primitive (`base.exchange`), so `jax.grad`, `jax.jvp`, `jax.vmap` and
`lax.scan` work through it as through `lax.psum`; the base class, the
primitive and the 16-bit helpers are in `base`, each route in its own module
(the native one beside its engine, `jdist.collectives.native`).

  * `LocalRoute` ("local"): one process, or backend "jax" (JAX's
    multi-process runtime): XLA collectives over `DATA_AXIS` already span
    every replica.
  * `Mpi4jaxRoute` ("mpi4jax"): one device per process: mpi4jax collectives
    inside the step (zero-copy on CPU; mpi4jax's ordered effects allow only
    one device).
  * `NativeRoute` ("native"): the default where it is built: one XLA FFI
    custom call per exchange and device into jdist's C++ engine, which
    reduces the local devices' parts and runs MPI across processes without
    blocking any XLA thread (see `jdist.collectives.native`).
  * `CallbackRoute` ("callback"): the fallback for several devices where the
    native library is not built. Hierarchical: the devices first
    reduce-scatter the buffer locally (XLA), then device d of every process
    exchanges its 1/D shard on its own communicator through a host callback
    running mpi4py, then the devices all-gather the shards.

`init()` is `jdist.init()`: the runtime starts the job
(`jdist.runtime.job.start`: topology and MPI world), then `start(topology,
name)` picks the route once, from `init(route=name)` (`JDIST_ROUTE` is the argument's default): native wherever its engine
runs (CPU devices; several devices per process on GPUs), else mpi4jax (one
device per process) or callback. The same route serves `jdist.data_parallel`
steps and jit steps over global arrays. 16-bit buffers
cross processes as uint16 bit patterns (MPI has no float16 sum): a
reduce-scatter, float32 accumulation, an all-gather. The started route and
engine are the job's (`jdist.runtime.job.Job.route`, `.engine`); reductions
read them from there, `active()` and `named(name)` for anyone else.
`ensure_job()` is for entry points that may run before the user's
`jdist.init()` (the first call of a `jdist.data_parallel` step, `jdist.mesh()`);
getters such as `jdist.get_topology()` start nothing.
"""

from __future__ import annotations

import dataclasses
import os
import warnings

from jdist.collectives import native as engine
from jdist.collectives.native import NativeRoute
from jdist.runtime import jax_distributed as jax_distributed_lib
from jdist.runtime import job as job_lib
from jdist.runtime import xla_cpu
from jdist.collectives.routes.base import Route
from jdist.collectives.routes.callback import CallbackRoute
from jdist.collectives.routes.local import LocalRoute
from jdist.collectives.routes.mpi4jax import Mpi4jaxRoute

ROUTE_ENV = "JDIST_ROUTE"  # the default of jdist.init(route=...)
ROUTES = ("local", "mpi4jax", "native", "callback")


def _start_native(topology, world) -> None:
  """Starts the native engine where it serves (collective: every process alike)."""
  why_not = engine.start(world, topology.local_device_count, topology.timeout)
  if why_not and topology.local_device_count > 1:
    warnings.warn(
        f"jdist: the native cross-process exchange is not available ({why_not}); "
        f"using the slower callback route. Build it with `python -m "
        f"jdist.collectives.native.build` (scripts/install.sh does).", RuntimeWarning,
        stacklevel=4)


def select(topology, name: str | None = None, *, source: str = "route", world=None) -> Route:
  """The route `name` for `topology`, or the automatic choice where `name` is None.

  Automatic: in one process (or with backend "jax"), XLA's collectives
  ("local"); under MPI, the native engine wherever it runs (its exchanges do
  not block XLA, so they run beside the rest of the backward pass), except
  one GPU per process, which keeps mpi4jax (the CUDA handler has not run on
  one); where it does not run, mpi4jax with one device per process, else
  the callback route.

  Args:
    topology: the initialized `Topology`.
    name: one of `ROUTES`, or None.
    source: how errors name the choice (`jdist.init(route=...)`'s argument
      or the `JDIST_ROUTE` environment variable).
    world: the job's MPI world (default: the started job's).

  Raises:
    ValueError: `name` is not a route, or one this job cannot take: "local"
      across MPI processes, a cross-process route in one process, "native"
      where the engine is not running, "mpi4jax" with several devices per
      process.
  """
  label = f"{source}={name!r}"
  if name is not None and name not in ROUTES:
    raise ValueError(f"{label} is not a jdist route: choose one of {', '.join(ROUTES)}, "
                     f"or None for the automatic choice.")
  if topology.process_count == 1 or topology.backend == "jax":
    if name not in (None, "local"):
      where = ("one process" if topology.process_count == 1
               else "backend 'jax', whose XLA collectives span every process")
      raise ValueError(f"{label}: this job runs {where}, where reductions take XLA's own "
                       f"collectives; choose route 'local' or None.")
    return LocalRoute(topology)
  if name == "local":
    raise ValueError(f"{label}: XLA's collectives do not cross the {topology.process_count} "
                     f"MPI processes of this job; choose 'native', 'mpi4jax' or 'callback', "
                     f"or None for the automatic choice.")
  world = world if world is not None else job_lib.world()
  one_device = topology.local_device_count == 1
  if name == "callback":
    return CallbackRoute(topology, world)
  if name == "mpi4jax":
    if not one_device:
      raise ValueError(f"{label} needs one device per process (mpi4jax's ordered effects "
                       f"refuse {topology.local_device_count}); choose 'native' or "
                       f"'callback'.")
    return Mpi4jaxRoute(topology, world)
  if name == "native":
    if not engine.running():
      raise ValueError(f"{label}, but the native exchange is not available: "
                       f"{engine.unavailable_reason() or 'jdist.init() did not start it'}. "
                       f"Build it with `python -m jdist.collectives.native.build`, or "
                       f"choose 'callback' or None.")
    return NativeRoute(topology)
  if not engine.running() or (one_device and engine.platform_of_devices() != "cpu"):
    return Mpi4jaxRoute(topology, world) if one_device else CallbackRoute(topology, world)
  return NativeRoute(topology)


def _warn_small_thread_pool(topology) -> None:
  """Warns where a user's small `NPROC` leaves XLA too few CPU threads.

  In a jit step over global arrays XLA runs its own collectives between the
  local devices (the gradient's all-reduce over the sharded batch), and each
  blocks a thread of XLA's CPU pool until every local device arrives; the
  native exchanges beside them hold no thread, but a device whose next
  collective finds no free thread never posts its part. Measured: the jit
  quickstart in 2x2 with NPROC=2 stalled in 1 of 3 runs (rank 1's only
  working pool thread in XLA's Gloo all-reduce, waiting for its other device,
  whose exchange rank 0 waited for), none in 7 runs with jdist's default
  (`jdist.runtime.xla_cpu.reserve_host_threads`). The callback route blocks
  a thread per device as well.
  """
  threads = os.environ.get("NPROC", "")
  if (topology.local_device_count > 1 and threads.isdigit()
      and int(threads) < xla_cpu.MIN_HOST_THREADS and engine.platform_of_devices() == "cpu"):
    warnings.warn(
        f"jdist: NPROC={threads} gives XLA's CPU pool too few threads for "
        f"{topology.local_device_count} devices per process exchanging across processes: "
        f"steps may deadlock. Unset NPROC (jdist.init() then sets "
        f"{xla_cpu.MIN_HOST_THREADS}) or set it to at least {xla_cpu.MIN_HOST_THREADS}.",
        RuntimeWarning, stacklevel=4)


def start(job: job_lib.Job, name: str | None = None, *, source: str = "route") -> Route:
  """Starts the route of a new `job` (from `jdist.init`, once): sets its route and engine.

  Starts the native engine under MPI (collective: every process alike), then
  checks the route asked for (`select`).
  """
  topology = job.topology
  if topology.backend == "mpi" and topology.process_count > 1:
    _start_native(topology, job.world)
    _warn_small_thread_pool(topology)
    job.engine = engine if engine.running() else None
  job.route = select(topology, name, source=source, world=job.world)
  return job.route


def _requested(route: str | None) -> tuple[str | None, str]:
  """The route asked for: `route`, else `JDIST_ROUTE`; and how errors name it."""
  if route is not None:
    return route, "jdist.init(route)"
  forced = os.environ.get(ROUTE_ENV, "").strip()
  return (forced or None), ROUTE_ENV


def _route_starter(route: str | None):
  name, source = _requested(route)

  def start_route(job: job_lib.Job):
    return dataclasses.replace(job.topology, route=start(job, name, source=source).name)
  return start_route


def init(*, timeout: float | None = None, backend: str | None = None,
         bind_gpu: bool | None = None, jax_distributed: bool | None = None,
         route: str | None = None):
  """Sets up the data-parallel world and returns this process's `Topology`.

  Idempotent: later calls return the first call's object (arguments of later
  calls must agree with it or be left out). The job it sets up (topology, MPI
  world, route, engine) is `jdist.runtime.job.get()`.

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
                     f"{', '.join(ROUTES)}, or None.")
  started = job_lib.get()
  if route is not None and started is not None and route != started.topology.route:
    raise ValueError(f"jdist.init(route={route!r}) after jdist was initialized with "
                     f"route={started.topology.route!r}; call init once, first.")
  return job_lib.start(timeout=timeout, backend=backend, bind_gpu=bind_gpu,
                       jax_distributed=jax_distributed_lib.wanted(jax_distributed),
                       finish=_route_starter(route)).topology


def ensure_job() -> job_lib.Job:
  """The started job, initializing jdist with defaults if nothing has."""
  job = job_lib.get()
  if job is None:
    init()
    job = job_lib.get()
  return job


def active() -> Route:
  """The route `init()` started; before it, a single process's local route.

  Raises:
    jdist.errors.JdistError: not initialized under an MPI launcher.
  """
  job = job_lib.get()
  if job is not None:
    return job.route
  return LocalRoute(job_lib.current())  # raises under mpirun before jdist.init()


def route() -> str:
  """How buffers cross processes in this job's steps: "local", "mpi4jax", "native"
  or "callback" (the route `jdist.init()` chose, for both kinds of step)."""
  return active().name


def named(name: str | None) -> Route:
  """The route `name` of this job (the started one for None), one object per name.

  For measurements and tests that compare routes in one job
  (`jdist.collectives.on_route`); every process must ask for the same.

  Raises:
    ValueError: as `jdist.init(route=name)` would, for a route this job
      cannot take.
  """
  started = active()
  if name is None or name == started.name:
    return started
  job = job_lib.get()
  if job is None:  # one process before jdist.init(): nothing to keep it in
    return select(job_lib.current(), name)
  if name not in job.routes:
    job.routes[name] = select(job.topology, name)
  return job.routes[name]
