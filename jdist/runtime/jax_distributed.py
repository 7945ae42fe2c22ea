"""JAX's own process identity under mpirun: `jax.distributed`, started over MPI.

With the "mpi" backend, jdist moves buffers across processes itself (mpi4jax
or its native exchange), and JAX, left alone, believes it is a single
process: `jax.process_index()` is 0 and `jax.process_count()` 1 on every
rank. Libraries that ask JAX who they are then go wrong: orbax's
`CheckpointManager` has every rank write the same files, grain's
`ShardByJaxProcess` hands every rank the same shard.

`start(world)` runs `jax.distributed.initialize` with the MPI rank and size,
right after MPI starts and before JAX creates its backends. Rank 0 picks the
coordinator's address (a free port on an address of its host) and MPI carries
it to the others. jdist's own routes do not change: steps still exchange
through mpi4jax or the native library across processes and XLA within one.
What changes is what JAX reports: `jax.process_index()`/`process_count()`,
and `jax.devices()`, which now lists every process's devices (jdist builds
its meshes from `jax.local_devices()`).

XLA's CPU client gets no cross-process collectives (`keep_cpu_collectives_local`):
JAX's default, Gloo, would carry every XLA collective over TCP, a sum
between two devices of one process included, and fails to start where host
names do not resolve. The few computations that span processes
(`jax.experimental.multihost_utils`) run over MPI instead
(`jdist.runtime.multihost`).

Controlled by `jdist.init(jax_distributed=...)` or the `JDIST_JAX_DISTRIBUTED`
environment variable ("0" turns it off); on by default under mpirun.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import jax

from jdist import errors
from jdist.runtime import jax_internals
from jdist.runtime import multihost

ENV = "JDIST_JAX_DISTRIBUTED"
TIMEOUT_ENV = "JDIST_COORDINATOR_TIMEOUT"
DEFAULT_TIMEOUT_S = 60  # every rank has already met over MPI: connecting is quick
ADDRESS_ENV = "JAX_COORDINATOR_ADDRESS"  # JAX's own override, honoured as JAX does
COLLECTIVES_ENV = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"  # JAX's own setting: a user's choice
_JAX_DEFAULT_COLLECTIVES = "gloo"

_started_s: float | None = None  # seconds start() took, for measurements


def wanted(explicit: bool | None) -> bool:
  """Whether to start JAX's distributed runtime: `explicit`, else the environment, else True.

  Raises:
    ValueError: `JDIST_JAX_DISTRIBUTED` is not 0/1/true/false.
  """
  if explicit is not None:
    return bool(explicit)
  raw = os.environ.get(ENV)
  if raw is None:
    return True
  value = raw.strip().lower()
  if value in ("1", "true", "yes", "on"):
    return True
  if value in ("0", "false", "no", "off"):
    return False
  raise ValueError(f"{ENV}={raw!r}: use 1 (start JAX's distributed runtime under mpirun, "
                   f"the default) or 0 (JAX sees one process on every rank).")


def _timeout() -> int:
  raw = os.environ.get(TIMEOUT_ENV)
  if raw is None:
    return DEFAULT_TIMEOUT_S
  try:
    seconds = int(float(raw))
  except ValueError:
    raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds.") from None
  if seconds < 1:
    raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be at least 1 second.")
  return seconds


def _interface_addresses() -> list[str]:
  """This host's IPv4 addresses, one per interface that has one, loopback left out."""
  import fcntl  # pylint: disable=g-import-not-at-top
  import struct  # pylint: disable=g-import-not-at-top
  found = []
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    for _, name in socket.if_nameindex():
      try:  # SIOCGIFADDR: the interface's IPv4 address
        packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
      except OSError:
        continue  # no IPv4 address on it
      address = socket.inet_ntoa(packed[20:24])
      if not address.startswith("127.") and address not in found:
        found.append(address)
  return found


def _host_candidates(all_on_one_node: bool) -> list[str]:
  """Addresses of this host the other ranks may reach it by, most likely first.

  The host name's address when it resolves to one that is not loopback, then
  every interface's address, then the name itself. Names alone fail where
  nodes do not resolve each other's names (measured on the namespace rig:
  JAX's client aborted rank 0 with an unresolvable 'nodeA').
  """
  if all_on_one_node:
    return ["127.0.0.1"]
  name = socket.gethostname()
  candidates = []
  try:
    resolved = socket.gethostbyname(name)
    if not resolved.startswith("127."):
      candidates.append(resolved)
  except OSError:
    pass
  try:
    candidates += [a for a in _interface_addresses() if a not in candidates]
  except OSError:
    pass
  return candidates + [name]


def coordinator_candidates(world) -> list[str]:
  """Rank 0's possible `host:port`s for JAX's coordinator, agreed by every rank over MPI.

  `JAX_COORDINATOR_ADDRESS`, where set, is the only one, as JAX would use it.
  """
  address = os.environ.get(ADDRESS_ENV)
  candidates = [address] if address else None
  if address is None and world.rank == 0:
    with socket.socket() as probe:  # a port free now; the coordinator binds it next
      probe.bind(("", 0))
      port = probe.getsockname()[1]
    candidates = [f"{host}:{port}" for host in _host_candidates(world.local_size == world.size)]
  return world.allgather_object(candidates, "jax.distributed coordinator")[0]


def _advice() -> str:
  return (f"Check that every host can reach rank 0's host at that address (firewall, "
          f"interface), set {ADDRESS_ENV}=host:port to choose it, raise {TIMEOUT_ENV}, or "
          f"run without JAX's process identity: jdist.init(jax_distributed=False) or {ENV}=0.")


def _first_line(err: BaseException) -> str:
  text = str(err).strip().splitlines()
  return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def _listening(candidates: list[str], limit: float) -> str | None:
  """The first of `candidates` that accepts TCP connections within `limit` s, or None."""
  deadline = time.monotonic() + limit
  while time.monotonic() < deadline:
    for address in candidates:
      host, port = address.rsplit(":", 1)
      try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1):
          return address
      except OSError:
        continue
    time.sleep(0.005)
  return None


def _initialize(world, candidates: list[str], timeout: int) -> None:
  """`jax.distributed.initialize`, the other ranks connecting once rank 0's service listens.

  A client that connects before the coordinator's service is up retries
  after gRPC's backoff (1 s, then 1.6 s, ...): measured, jdist.init() then
  took 1.0-2.0 s longer in 2 x 1 and 2 x 2 in about half the runs. Rank 0
  starts the service in a thread, sees it accept connections, then lets
  the others connect (its own initialize returns once everyone has). The
  service listens on every interface, so each rank connects by the first
  of rank 0's addresses that it reaches.
  """
  def initialize(address):
    jax.distributed.initialize(coordinator_address=address, num_processes=world.size,
                               process_id=world.rank, cluster_detection_method="deactivate",
                               initialization_timeout=timeout)

  failure: list[BaseException] = []

  def run(address):
    try:
      initialize(address)
    except BaseException as err:  # pylint: disable=broad-except
      failure.append(err)

  starter = None
  if world.rank == 0:
    # Its own service, on its own host: loopback always reaches it.
    own = (candidates[0] if os.environ.get(ADDRESS_ENV)
           else "127.0.0.1:" + candidates[0].rsplit(":", 1)[1])
    starter = threading.Thread(target=run, args=(own,), name="jdist-jax-coordinator",
                               daemon=True)
    starter.start()
    reached = _listening([own], min(timeout / 2, 10))
    world.barrier("jax.distributed coordinator started")
  else:
    world.barrier("jax.distributed coordinator started")
    reached = _listening(candidates, timeout)
  # JAX's client ends the process (SIGABRT, its own log line) when it cannot
  # register with the coordinator, so every rank checks the address first.
  verdicts = world.allgather_object(reached is not None, "jax.distributed coordinator reached")
  missing = [rank for rank, ok in enumerate(verdicts) if not ok]
  if missing:
    raise errors.CoordinatorError(
        f"rank(s) {', '.join(map(str, missing))} could not connect to JAX's coordinator at "
        f"{' or '.join(candidates)} (started by rank 0) within {timeout} s. {_advice()}")
  if starter is None:
    initialize(reached)
    return
  starter.join()
  if failure:
    raise failure[0]


def start(world, *, xla_collectives: bool = False) -> None:
  """Starts JAX's distributed runtime as MPI rank `world.rank` of `world.size`.

  Args:
    world: the started `jdist.runtime.world.MpiWorld`.
    xla_collectives: keep JAX's cross-process CPU collectives (Gloo) for XLA,
      which backend "jax" computes with; otherwise XLA gets none
      (`keep_cpu_collectives_local`).

  Raises:
    jdist.errors.InitOrderError: JAX already created its backends, so its
      distributed runtime can no longer start.
    jdist.errors.CoordinatorError: the coordinator was not reached within
      `JDIST_COORDINATOR_TIMEOUT` seconds (default 60).
  """
  global _started_s
  if jax.distributed.is_initialized():
    return
  began = time.perf_counter()
  if jax_internals.backends_initialized():
    raise errors.InitOrderError(
        f"jdist.init() ran after JAX started its backends (a jax.devices() call, an array or "
        f"a computation came first), so JAX's distributed runtime can no longer start and "
        f"jax.process_index() would be 0 on every rank (orbax and grain would then act as "
        f"if each rank were alone). Fix: call jdist.init() before any other JAX call (right "
        f"after the imports), or run without JAX's process identity: "
        f"jdist.init(jax_distributed=False) or {ENV}=0 in the environment.")
  if not xla_collectives:
    keep_cpu_collectives_local(world)
  jax_internals.cache_programs_on_every_process()
  candidates = coordinator_candidates(world)
  timeout = _timeout()
  try:
    _initialize(world, candidates, timeout)
  except errors.CoordinatorError:
    raise
  except Exception as err:  # pylint: disable=broad-except
    raise errors.CoordinatorError(
        f"rank {world.rank}: JAX's distributed runtime did not start with its coordinator at "
        f"{' or '.join(candidates)} ({_first_line(err)}). {_advice()}") from err
  _started_s = time.perf_counter() - began


def keep_cpu_collectives_local(world) -> str | None:
  """Gives XLA's CPU client no cross-process collectives, unless the user chose some.

  Measured with Gloo (JAX's default), 2 processes x 2 devices, SINGA CNN jit
  step: 44.5 / 39.4 ms against 22.2 / 20.5 ms without it, 4.3 MB a step
  through the loopback's TCP for sums inside each process. Without
  collectives XLA sums a process's devices in shared memory, and
  `multihost_utils` exchanges over MPI (`multihost.install`).

  A choice in the environment (`JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo`) or
  made with `jax.config.update` before `jdist.init()` is kept.

  Args:
    world: the started MPI world, which `multihost_utils` then exchanges over.

  Returns:
    The CPU collectives XLA will use: None, "gloo" or "mpi".
  """
  chosen = jax.config.jax_cpu_collectives_implementation
  if COLLECTIVES_ENV not in os.environ and chosen == _JAX_DEFAULT_COLLECTIVES:
    jax.config.update("jax_cpu_collectives_implementation", None)
    chosen = None
  if chosen is None:
    multihost.install(world)
  return chosen


def startup_seconds() -> float | None:
  """Seconds `start()` took on this process, None if it did not run."""
  return _started_s
