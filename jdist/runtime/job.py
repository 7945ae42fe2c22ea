"""The job: everything `jdist.init()` set up in this process, in one object.

`Job` holds the job's `Topology` (who is where), its MPI world (host
exchanges and the watchdog; None in one process), the route steps exchange
buffers on and the native engine. The runtime starts the world (`start`,
the runtime's half of `jdist.init()`); the collective layer, which this
module does not import, then fills in the route and the engine from the
`finish` it passes. `get()` is the started job (None before `jdist.init()`),
`current()` its `Topology` (`jdist.get_topology()`, a getter that starts
nothing). A step reaches the runtime through the job alone: the watchdog's
notes (`step_traced`, `step_dispatched`) and the structure check of a tree
that crosses processes (`check_structure`).

In one process before `jdist.init()`, `current()` is a one-process
topology that initializes nothing: a later `jdist.init(...)` still sets the
job up.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jdist import errors
from jdist.runtime import topology as topology_lib
from jdist.runtime import xla_cpu
from jdist.runtime.topology import Topology


class Job:
  """This process's part of the data-parallel job, as `jdist.init()` set it up.

  Attributes:
    topology: the `Topology` `jdist.init()` returns (its `route` named).
    world: the `jdist.runtime.world.MpiWorld` of a job launched by MPI, else
      None.
    route: the route reductions take across processes
      (`jdist.collectives.routes.Route`), set once by the collective layer.
    routes: routes other than `route` asked for by name in this job
      (`jdist.collectives.on_route`), one object per name.
    engine: the native exchange engine (`jdist.collectives.native`: its
      process-wide C++ library) where the job started it, else None.
    exchanging: the world where it has several processes to exchange with,
      else None (what a step's notes and checks need).
  """

  def __init__(self, topology: Topology, world=None):
    self.topology = topology
    self.world = world
    self.route = None
    self.routes: dict[str, Any] = {}
    self.engine = None
    self.exchanging = world if world is not None and world.size > 1 else None

  def __repr__(self) -> str:
    return f"Job({self.topology}, route={getattr(self.route, 'name', None)!r})"

  def step_traced(self, name: str, args: Any) -> None:
    """Tells the watchdog step `name` is traced, with its arguments' shapes.

    Runs only while tracing: a re-trace's shapes, for a divergence report.
    """
    if self.exchanging is not None:
      self.exchanging.watchdog.note_trace(name, args)

  def step_dispatched(self, marker: Any, name: str) -> None:
    """Tells the watchdog a step was dispatched; `marker` is ready when it ends."""
    if self.exchanging is not None:
      self.exchanging.watchdog.step_dispatched(marker, name)

  def check_structure(self, tree: Any, what: str) -> None:
    """Checks that every process holds a pytree of the same signature.

    Host side (call at trace time or outside jit). A no-op in one process.

    Raises:
      jdist.errors.StructureMismatchError: on every rank, naming the first
        differing leaf.
    """
    world = self.exchanging
    if world is None:
      return
    signature = _signature(tree)
    digest = hashlib.sha256(repr(signature).encode()).hexdigest()
    digests = world.allgather_object(digest, f"structure check of {what}")
    if len(set(digests)) == 1:
      return
    signatures = world.allgather_object(signature, f"structure check of {what}")
    raise errors.StructureMismatchError(_describe_mismatch(signatures, what))


def _signature(tree: Any) -> list[tuple[str, tuple[int, ...], str]]:
  """[(leaf path, shape, dtype), ...] of every leaf of `tree`."""
  return [(jax.tree_util.keystr(path), tuple(leaf.shape), str(jnp.dtype(leaf.dtype)))
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def _describe_mismatch(signatures: list[list[tuple]], what: str) -> str:
  reference = signatures[0]
  for rank, other in enumerate(signatures[1:], start=1):
    for index in range(max(len(reference), len(other))):
      mine = reference[index] if index < len(reference) else None
      theirs = other[index] if index < len(other) else None
      if mine != theirs:
        def show(entry):
          return "no leaf" if entry is None else f"{entry[0]} shape={entry[1]} dtype={entry[2]}"
        return (f"{what}: processes hold different pytrees, so they cannot be "
                f"reduced together. First difference at leaf #{index}: rank 0 has "
                f"{show(mine)}, rank {rank} has {show(theirs)}. Every process must "
                f"build the same model and optimizer (same shapes and dtypes).")
  return f"{what}: processes hold different pytree structures ({len(reference)} leaves on rank 0)."


_lock = threading.Lock()
_job: Job | None = None  # the started job: the one place jdist's process-wide state lives
_one_process: Topology | None = None  # `current()` before jdist.init(), in one process


def _check_agrees(job: Job, backend: str | None, timeout: float | None) -> None:
  """Raises ValueError where a later `jdist.init(...)` disagrees with the first."""
  topology = job.topology
  if backend is not None and backend != topology.backend:
    raise ValueError(
        f"jdist.init(backend={backend!r}) after jdist was initialized with "
        f"backend={topology.backend!r}; call init once, first.")
  if timeout is not None and topology_lib.resolve_timeout(timeout) != topology.timeout:
    raise ValueError(
        f"jdist.init(timeout={timeout!r}) after jdist was initialized with "
        f"timeout={topology.timeout:g}; call init once, first.")


def start(*, timeout: float | None = None, backend: str | None = None,
          bind_gpu: bool | None = None, jax_distributed: bool = True,
          finish: Callable[[Job], Topology] | None = None) -> Job:
  """Discovers and starts the processes' world, once; returns the job.

  The runtime's half of `jdist.init` (see its documentation for the
  arguments, errors and idempotence): it starts MPI and, for backend "jax",
  JAX's multi-process runtime, and knows nothing of how steps exchange
  buffers. The collective layer passes `finish`, which starts its route.

  Args:
    timeout: see `jdist.init`.
    backend: see `jdist.init`.
    bind_gpu: see `jdist.init`.
    jax_distributed: under mpirun, also start JAX's distributed runtime
      (see `jdist.init`); backend "jax" always does.
    finish: called once, under the initialization lock, with the new job;
      it sets the job's route and engine and returns the topology to
      publish (its `route` named).

  Returns:
    The `Job` of this process: the first call's on every later call.

  Raises:
    jdist.errors.MissingMPIError: launched by mpirun but mpi4py/mpi4jax are
      not installed.
    ValueError: an unknown backend or a bad timeout, or arguments that
      disagree with the first call's.
  """
  global _job
  with _lock:
    if _job is not None:
      _check_agrees(_job, backend, timeout)
      return _job
    resolved_timeout = topology_lib.resolve_timeout(timeout)
    if backend is None:
      backend = "mpi" if topology_lib.launched_by_mpi() else "none"
    if backend not in topology_lib.BACKENDS:
      raise ValueError(f"backend={backend!r} is not one of 'mpi', 'jax', 'none'.")
    if backend == "none" and topology_lib.launched_by_mpi():
      raise ValueError(
          "backend='none' but this process was started by mpirun with several "
          "processes; use backend='mpi' (the default) or 'jax'.")
    xla_cpu.avoid_slow_concatenation()
    job = Job(*topology_lib.BACKENDS[backend](resolved_timeout, bind_gpu, jax_distributed))
    if finish is not None:
      job.topology = finish(job)
    _job = job
    return job


def get() -> Job | None:
  """The job `jdist.init()` started, or None before it (starts nothing)."""
  return _job


def world():
  """The MPI world of a job launched by MPI, else None (starts nothing)."""
  return _job.world if _job is not None else None


def current() -> Topology:
  """The initialized `Topology`; a getter: it never starts MPI.

  Before `jdist.init()`, a plain single process gets the one-process
  topology (nothing is initialized: a later `jdist.init(...)` still sets the
  job up).

  Raises:
    jdist.errors.JdistError: not initialized in a process that an MPI
      launcher started with several processes.
  """
  global _one_process
  if _job is not None:
    return _job.topology
  if topology_lib.launched_by_mpi():
    raise errors.JdistError(
        "jdist is not initialized, but this process was started by an MPI launcher "
        "with several processes: call jdist.init() first, on every process, before "
        "anything that needs the job's topology (jdist.get_topology(), jdist.mesh(), "
        "jdist.broadcast_params, reductions).")
  if _one_process is None:
    _one_process = topology_lib.one_process(topology_lib.resolve_timeout(None))
  return _one_process


def is_initialized() -> bool:
  return _job is not None


def check_structure(tree: Any, what: str) -> None:
  """`Job.check_structure` on the host, between steps: a no-op in one process.

  Raises:
    jdist.errors.JdistError: under an MPI launcher before `jdist.init()`
      (rather than checking nothing).
    jdist.errors.StructureMismatchError: see `Job.check_structure`.
  """
  if _job is None:
    current()  # under an MPI launcher: raises, naming jdist.init()
    return
  _job.check_structure(tree, what)
