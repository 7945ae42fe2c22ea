"""Routes: how 1-D buffers cross every replica inside a step, one object each.

Every route offers three primitives over all replicas (local devices, then
processes): `sum_all` (full precision), `sum_all_16bit` (16-bit payload,
float32 accumulation) and `gather_all` (replica-ordered all-gather), and
records the bytes they send across processes (`jdist.collectives.wire`).
A route that crosses processes runs each exchange as the lowering of one JAX
primitive (`jdist.collectives.autodiff`), so `jax.grad`, `jax.jvp`,
`jax.vmap` and `lax.scan` work through it as through `lax.psum`; the base
class and the 16-bit helpers are in `base`, each route in its own module.

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

`start(topology, name)` picks the route once, when `jdist.init(route=name)`
runs (`JDIST_ROUTE` is the argument's default): native wherever its engine
runs (CPU devices; several devices per process on GPUs), else mpi4jax (one
device per process) or callback. The same route serves `jdist.data_parallel`
steps and jit steps over global arrays. 16-bit buffers
cross processes as uint16 bit patterns (MPI has no float16 sum): a
reduce-scatter, float32 accumulation, an all-gather.
"""

from __future__ import annotations

import os
import warnings

# `engine`, not `native`: importing the route module routes.native rebinds that name here.
from jdist.collectives import native as engine
from jdist.runtime import world as world_lib
from jdist.runtime import xla_cpu
from jdist.collectives.routes.base import Route
from jdist.collectives.routes.callback import CallbackRoute
from jdist.collectives.routes.local import LocalRoute
from jdist.collectives.routes.mpi4jax import Mpi4jaxRoute
from jdist.collectives.routes.native import NativeRoute

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


def select(topology, name: str | None = None, *, source: str = "route") -> Route:
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
  world = world_lib.get()
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


def start(topology, name: str | None = None, *, source: str = "route") -> Route:
  """Starts the route for an initialized `topology` (from `jdist.init`, once).

  Starts the native engine under MPI (collective: every process alike), then
  checks the route asked for (`select`).
  """
  if topology.backend == "mpi" and topology.process_count > 1:
    _start_native(topology, world_lib.get())
    _warn_small_thread_pool(topology)
  return select(topology, name, source=source)
