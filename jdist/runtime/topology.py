"""Who is where: processes, local devices and replicas.

`Topology` describes this process's place in the job; `BACKENDS` holds the
starters `jdist.runtime.job.start` (the runtime's half of `jdist.init()`)
runs once to discover it. Launched by `mpirun` (an MPI environment with
more than one process) a starter starts the MPI world; launched as a plain
`python` process it needs no MPI at all. The started topology is the job's
(`jdist.runtime.job.current`).

A *replica* is one device of one process: the unit of data parallelism. The
global replica index of local device `d` on process `p` is
`p * local_device_count + d`, so replicas are numbered process-major.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import jax

from jdist.runtime import abort
from jdist.runtime import world
from jdist.runtime import xla_cpu

# Environment variables set by MPI launchers for every rank they start.
_LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS")
_LAUNCHER_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "PMI_LOCAL_RANK")
_LAUNCHER_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")

TIMEOUT_ENV = "JDIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
INIT_TIMEOUT_ENV = "JDIST_INIT_TIMEOUT"
MIN_INIT_TIMEOUT_S = 300.0  # ranks may start minutes apart on a loaded machine


@dataclasses.dataclass(frozen=True)
class Topology:
  """Where this process stands in the data-parallel job.

  Attributes:
    process_index: rank of this process among all processes (MPI rank).
    process_count: number of processes (MPI world size; 1 without mpirun).
    local_device_count: devices this process drives with `jax.pmap`.
    local_rank: rank of this process among the processes on its node; the
      GPU it binds when each process drives one GPU.
    local_process_count: processes on this node.
    node_index: index of this process's node (host), numbered in the order
      of each node's lowest rank; 0 in a single process.
    node_count: number of nodes (distinct hosts) the job spans.
    hostname: this process's host name, as MPI and its launcher see it.
    backend: "mpi" (mpi4jax across processes), "jax" (JAX's own
      multi-process collectives) or "none" (a single process).
    timeout: seconds any cross-process exchange may wait before the watchdog
      names the missing ranks and aborts the job.
    route: how buffers cross processes inside a step (see
      `jdist.collectives.route`): "local" (one process, or backend "jax"),
      "mpi4jax" (one device per process), "native" (jdist's compiled
      exchange, several devices per process) or "callback" (its fallback
      through host callbacks, where the native library is not built): the
      route of `jdist.data_parallel` steps, chosen once by
      `jdist.init(route=...)`.
  """

  process_index: int
  process_count: int
  local_device_count: int
  local_rank: int = 0
  local_process_count: int = 1
  node_index: int = 0
  node_count: int = 1
  hostname: str = dataclasses.field(default_factory=socket.gethostname)
  backend: str = "none"
  timeout: float = DEFAULT_TIMEOUT_S
  route: str = "local"

  @property
  def jit_route(self) -> str:
    """The route of reductions in jit steps over global arrays: `route`, as in every step."""
    return self.route

  @property
  def replica_count(self) -> int:
    """Total replicas: every local device of every process."""
    return self.process_count * self.local_device_count

  @property
  def replica_indices(self) -> tuple[int, ...]:
    """Global replica indices of this process's local devices, in device order."""
    first = self.process_index * self.local_device_count
    return tuple(range(first, first + self.local_device_count))

  def replica_index(self, local_device: int) -> int:
    """Global replica index of local device number `local_device`."""
    if not 0 <= local_device < self.local_device_count:
      raise ValueError(
          f"local_device={local_device} is out of range: this process has "
          f"{self.local_device_count} local devices.")
    return self.process_index * self.local_device_count + local_device

  @property
  def is_primary(self) -> bool:
    """True on process 0, the one that prints, logs and writes checkpoints."""
    return self.process_index == 0

  @property
  def multi_process(self) -> bool:
    return self.process_count > 1

  def __str__(self) -> str:
    nodes = f" on {self.node_count} nodes" if self.node_count > 1 else ""
    return (f"process {self.process_index}/{self.process_count}{nodes} x "
            f"{self.local_device_count} local devices = {self.replica_count} "
            f"replicas (backend {self.backend}, route {self.route})")


def launched_by_mpi() -> bool:
  """True when an MPI launcher started this process as one of several."""
  for name in _LAUNCHER_SIZE_VARS:
    value = os.environ.get(name)
    if value is not None and value.isdigit() and int(value) > 1:
      return True
  return False


def _first_int(names: tuple[str, ...]) -> int | None:
  for name in names:
    value = os.environ.get(name)
    if value is not None and value.isdigit():
      return int(value)
  return None


def _launcher_local_rank() -> int | None:
  return _first_int(_LAUNCHER_LOCAL_RANK_VARS)


def launcher_rank() -> int:
  """This process's rank as the MPI launcher set it (0 when not launched by one).

  Read from the launcher's environment, so it is known before MPI starts (to
  print a usage error once, not once per rank).
  """
  return _first_int(_LAUNCHER_RANK_VARS) or 0


def _env_seconds(name: str) -> float | None:
  """The positive number of seconds in environment variable `name`, if set."""
  raw = os.environ.get(name)
  if raw is None:
    return None
  try:
    seconds = float(raw)
  except ValueError:
    raise ValueError(f"{name}={raw!r} is not a number of seconds.") from None
  if not seconds > 0:
    raise ValueError(f"{name}={raw!r} must be a positive number of seconds.")
  return seconds


def resolve_timeout(timeout: float | None) -> float:
  if timeout is None:
    timeout = _env_seconds(TIMEOUT_ENV)
    if timeout is None:
      return DEFAULT_TIMEOUT_S
  if not timeout > 0:
    raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
  return float(timeout)


def resolve_init_timeout(timeout: float) -> float:
  """Seconds every rank has to reach `jdist.init`: `JDIST_INIT_TIMEOUT`, else
  the larger of the exchange `timeout` and `MIN_INIT_TIMEOUT_S`."""
  seconds = _env_seconds(INIT_TIMEOUT_ENV)
  return max(timeout, MIN_INIT_TIMEOUT_S) if seconds is None else seconds


def nodes_of(hosts: list[str]) -> list[int]:
  """Each rank's node index, given each rank's host name.

  Nodes are numbered in the order of their lowest rank, so rank 0 is always
  on node 0, as launchers fill hosts in hostfile order.
  """
  order: dict[str, int] = {}
  return [order.setdefault(host, len(order)) for host in hosts]


def _bind_local_gpu(local_rank: int) -> None:
  """Makes this process see only GPU `local_rank` (one GPU per process)."""
  # Must happen before JAX creates its backends; later it cannot take effect.
  if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
    jax.config.update("jax_cuda_visible_devices", str(local_rank))


def one_process(timeout: float) -> Topology:
  """The topology of a single process, which drives every visible device."""
  return Topology(0, 1, jax.local_device_count(), backend="none", timeout=timeout)


def _single_process(timeout: float, bind_gpu: bool | None,
                    jax_distributed: bool = False) -> tuple[Topology, None]:
  del bind_gpu, jax_distributed  # one process drives every visible device
  return one_process(timeout), None


def _mpi_processes(backend: str):
  """The starter of a job of several processes launched by MPI, for `backend`."""

  def start(timeout: float, bind_gpu: bool | None,
            jax_distributed: bool) -> tuple[Topology, world.MpiWorld]:
    xla_cpu.reserve_host_threads(jax_distributed or backend == "jax", backend)
    # Raises MissingMPIError if mpi4py is absent. Backend "jax" runs its
    # collectives on JAX's runtime and XLA's cross-process collectives, so it
    # always starts it with them.
    mpi_world = world.start(timeout, resolve_init_timeout(timeout), launcher_rank(),
                            jax_distributed_runtime=jax_distributed or backend == "jax",
                            xla_collectives=backend == "jax")
    local_rank = _launcher_local_rank()
    if local_rank is None:
      local_rank = mpi_world.local_rank
    if bind_gpu is None:
      bind_gpu = mpi_world.local_size > 1
    if bind_gpu:
      _bind_local_gpu(local_rank)
    hosts = mpi_world.allgather_object(socket.gethostname(), "jdist.init: host names")
    nodes = nodes_of(hosts)
    topology = Topology(
        process_index=mpi_world.rank,
        process_count=mpi_world.size,
        local_device_count=jax.local_device_count(),
        local_rank=local_rank,
        local_process_count=mpi_world.local_size,
        node_index=nodes[mpi_world.rank],
        node_count=max(nodes) + 1,
        hostname=hosts[mpi_world.rank],
        backend=backend,
        timeout=timeout,
    )
    mpi_world.hosts = mpi_world.watchdog.hosts = hosts
    if mpi_world.rank == 0:
      abort.announce_hosts(hosts)
    mpi_world.attach(topology)
    return topology, mpi_world

  return start


# backend -> its starter: (timeout, bind_gpu, jax_distributed) -> (Topology, world or None).
BACKENDS = {"mpi": _mpi_processes("mpi"), "jax": _mpi_processes("jax"),
             "none": _single_process}
