"""The MPI world: the one place in jdist that imports mpi4py.

`start()` initializes MPI (thread level MULTIPLE: device threads and the
watchdog call MPI concurrently), duplicates the communicators jdist uses so
they never mix with a user's own MPI traffic, and starts the watchdog.

Communicators:
  * `comm`: a duplicate of COMM_WORLD for host-side exchanges (broadcast,
    structure checks, barriers) and for mpi4jax inside one-device steps.
  * `device_comm(d)`: one duplicate per local device index. With several
    local devices per process, device `d` of every process exchanges its
    shard on `device_comm(d)`, so concurrent calls from XLA's device threads
    never pair up wrongly. With one device per process, mpi4jax's
    collectives inside steps use `device_comm(0)`: a step that one rank runs
    while another is in a host exchange then waits (and the watchdog names
    it) instead of mixing with the host exchange's messages.
  * the watchdog's own duplicate, for progress queries.

Host-side exchanges use non-blocking MPI and poll with short sleeps, so a rank
waiting for a slow peer does not spin a CPU core the peer may need. Each
begins with one fixed-size gather of every rank's call (a digest of its kind
and label), its step count and its payload size: two different exchanges
that meet (a collective called on one rank only) are told apart there, and
the job ends with a report naming each rank's call and line, instead of
pairing one's payload with the other's.

A rank that never calls `jdist.init` (stalled or failed before it) would
leave the others blocked in `MPI_Init`, which Open MPI completes only once
every process has called it, or, where MPI was started earlier, in jdist's
first collective. `start()` puts a deadline on both (`init_timeout`, see
`jdist.init`). Past it, a rank still in `MPI_Init`
says why it waits (Open MPI's launcher does not end a job whose ranks are in
`MPI_Init`, even when one dies, so it keeps waiting); once MPI is up, the
peers meet with point-to-point messages, and missing ones are named and the
job is aborted.
"""

from __future__ import annotations

import atexit
import hashlib
import pickle
import sys
import threading
import time
from typing import Any

import numpy as np

from jdist import errors
from jdist.runtime import abort
from jdist.runtime import flight_recorder
from jdist.runtime import flight_report
from jdist.runtime import jax_distributed
from jdist.runtime import stall_report
from jdist.runtime import watchdog as watchdog_lib

_MISSING_MPI_HELP = (
    "This process was started by an MPI launcher (mpirun/mpiexec) with several "
    "processes, but {what} cannot be imported ({err}). Install the MPI extras "
    "into the environment the ranks run in: `bash scripts/install.sh`, or "
    "`pip install mpi4py` and then `pip install --no-build-isolation mpi4jax` "
    "(built against the MPI whose mpirun you use). To run on one process "
    "instead, start the script without mpirun.")


def _import_mpi():
  try:
    from mpi4py import MPI  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    raise errors.MissingMPIError(_MISSING_MPI_HELP.format(what="mpi4py", err=err)) from err
  return MPI


_HELLO_TAG = 27236  # jdist's meeting on COMM_WORLD before its first collective


def _import_mpi_within(limit: float, launcher_rank: int):
  """`_import_mpi()` (which initializes MPI), saying why if it takes over `limit` s."""
  done = threading.Event()

  def warn():
    if not done.wait(limit):
      # Open MPI's launcher does not end a job whose ranks are inside
      # MPI_Init, even when one of them dies, so this can only explain.
      sys.stderr.write(
          f"jdist: rank {launcher_rank} has waited {limit:g} s in jdist.init() "
          f"for MPI to start, which needs every process of the job: some rank has not "
          f"started MPI yet (it is slow, stalled or failed before jdist.init()). Still "
          f"waiting; stop the job if that rank is stuck (the limit is the "
          f"JDIST_INIT_TIMEOUT environment variable).\n")
      sys.stderr.flush()

  threading.Thread(target=warn, name="jdist-init-deadline", daemon=True).start()
  try:
    return _import_mpi()
  finally:
    done.set()


def meet(comm, limit: float) -> list[int]:
  """Exchanges a message with every peer; returns the peers missing after `limit` s."""
  rank, size = comm.Get_rank(), comm.Get_size()
  peers = [peer for peer in range(size) if peer != rank]
  inbox = {peer: np.zeros(1, np.int32) for peer in peers}
  receives = {peer: comm.Irecv(inbox[peer], source=peer, tag=_HELLO_TAG) for peer in peers}
  mine = np.array([rank], np.int32)
  sends = [comm.Isend(mine, dest=peer, tag=_HELLO_TAG) for peer in peers]
  deadline = time.monotonic() + limit
  pause = 1e-4
  while receives and time.monotonic() < deadline:
    receives = {peer: r for peer, r in receives.items() if not r.Test()}
    time.sleep(pause)
    pause = min(pause * 2, 0.05)
  if receives:
    return sorted(receives)
  for request in sends:
    request.Wait()  # received by now: every peer posted its receive before sending
  return []


_REPORTER_GRACE_S = 10.0  # how long the other ranks leave rank 0 to report


def _call_digest(kind: str, label: str) -> int:
  """A host exchange's call ("allgather", "jdist.barrier"...) as one int64, alike on every rank.

  A label's trailing " (...)" is this rank's detail (its batch's rows, say):
  it shows in reports, but is no part of which call this is, so ranks that
  make the same call with different details meet, and the call compares them.
  """
  call = label.split(" (", 1)[0]
  digest = hashlib.blake2b(f"{kind}:{call}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little", signed=True)


def import_mpi4jax():
  """mpi4jax, or a MissingMPIError that says how to install it."""
  try:
    import mpi4jax  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    raise errors.MissingMPIError(_MISSING_MPI_HELP.format(what="mpi4jax", err=err)) from err
  return mpi4jax


class MpiWorld:
  """MPI state of this process; created once by `start()`."""

  def __init__(self, mpi, timeout: float, init_timeout: float):
    self.MPI = mpi
    missing = meet(mpi.COMM_WORLD, init_timeout)
    if missing:
      sys.stderr.write(
          f"jdist: rank {mpi.COMM_WORLD.Get_rank()} waited {init_timeout:g} s in jdist.init() "
          f"for rank(s) {', '.join(map(str, missing))}, which never called it: they stalled or "
          f"failed before it. Aborting the job (raise the limit with the "
          f"JDIST_INIT_TIMEOUT environment variable).\n")
      sys.stderr.flush()
      mpi.COMM_WORLD.Abort(1)
    self.comm = mpi.COMM_WORLD.Dup()
    self.rank = self.comm.Get_rank()
    self.size = self.comm.Get_size()
    node = self.comm.Split_type(mpi.COMM_TYPE_SHARED, key=self.rank)
    self.local_rank = node.Get_rank()
    self.local_size = node.Get_size()
    node.Free()
    self.timeout = timeout
    self.thread_multiple = mpi.Query_thread() == mpi.THREAD_MULTIPLE
    self._device_comms: list[Any] = []
    self._exit_hooks: list = []
    self.watchdog = watchdog_lib.Watchdog(self.comm.Dup(), mpi, timeout=timeout)
    self.hosts: list[str] | None = None  # each rank's host name (set by jdist.init)

  def attach(self, topology) -> None:
    """Checks that every process drives as many devices, creates the
    per-device communicators and starts the watchdog.

    Raises:
      jdist.errors.WorldMismatchError: on every process, if the processes
        have different local device counts (each would create another number
        of communicators, and `MPI_Comm_dup` would fail on some ranks).
    """
    if not self._device_comms:
      counts = self.allgather_object(topology.local_device_count, "jdist.init: device counts")
      if len(set(counts)) > 1:
        shown = ", ".join(f"rank {rank} has {count}" for rank, count in enumerate(counts))
        raise errors.WorldMismatchError(
            f"jdist.init: the processes drive different numbers of local devices ({shown}). "
            f"Every process must have the same local device count (data parallelism needs "
            f"equal replicas per process): give every rank the same devices (e.g. the same "
            f"--cpu-devices, XLA_FLAGS or CUDA_VISIBLE_DEVICES count).")
      self._device_comms = [self.comm.Dup() for _ in range(topology.local_device_count)]
    self.watchdog.start()
    # Registered after mpi4py's own handler, so they run before MPI_Finalize;
    # atexit runs last-in first: live steps are awaited, then the watchdog
    # drains and announces this rank's departure, then the exit hooks run.
    atexit.register(self._run_exit_hooks)
    atexit.register(self.watchdog.shutdown)
    atexit.register(self._await_live_arrays)

  def on_exit(self, hook) -> None:
    """Runs `hook()` at exit after this rank's steps ended, before MPI_Finalize.

    For what the steps use until their end (the native exchange engine): an
    `atexit` hook registered later would run first, under steps still in
    flight, and strand them.
    """
    self._exit_hooks.append(hook)

  def _run_exit_hooks(self) -> None:
    for hook in reversed(self._exit_hooks):
      hook()

  def _await_live_arrays(self) -> None:
    """Waits at exit for the computations of every live array, up to the deadline.

    A jit step (global arrays) is dispatched by the user's own `jax.jit`, not
    by `data_parallel`, so the watchdog does not drain it: a rank that ends
    its script with steps still running would finalize Python under their
    host callbacks and abort the job (seen in 2x2). Not a host exchange: the
    watchdog's exchange counts, which peers compare, stay as they are.
    """
    import jax  # pylint: disable=g-import-not-at-top

    def wait_all():
      for array in jax.live_arrays():
        try:
          array.block_until_ready()
        except Exception:  # pylint: disable=broad-except
          pass  # a failed or deleted computation has nothing left to wait for

    waiter = threading.Thread(target=wait_all, name="jdist-exit-wait", daemon=True)
    waiter.start()
    waiter.join(self.timeout)
    if waiter.is_alive():
      sys.stderr.write(f"jdist: rank {self.rank}: steps still running {self.timeout:g} s after "
                       f"the script ended (a peer stopped exchanging); aborting the job.\n")
      sys.stderr.flush()
      self.abort(1)

  def device_comm(self, local_device: int):
    return self._device_comms[local_device]

  # Host-side exchanges, each under the watchdog's deadline.

  def _wait(self, request, label: str) -> None:
    # Entered even when the request completes at once: every rank counts its
    # host exchanges alike, which departure detection compares.
    with self.watchdog.waiting(label):
      pause = 1e-5
      while not request.Test():
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)

  def _check_steps(self, steps: np.ndarray, label: str) -> None:
    """Raises on every rank if the ranks dispatched different numbers of steps.

    Every rank runs the same steps and host exchanges in the same order, so
    at each host exchange every rank has dispatched as many compiled steps.
    A rank with one batch more (uneven inputs) or a loop left early on one
    rank shows here, before its steps pair up with the wrong ones.
    """
    if len(set(steps.tolist())) > 1:
      shown = ", ".join(f"rank {rank} {count}" for rank, count in enumerate(steps.tolist()))
      raise errors.WorldMismatchError(
          f"{label}: the ranks ran different numbers of jdist.data_parallel steps before this "
          f"exchange ({shown}): uneven inputs (one rank had more batches) or a loop left "
          f"early on one rank. Every rank must run the same steps: give each the same "
          f"number of batches (jdist.ShardedLoader does, from data of the same size), and "
          f"stop every rank's loop alike.")

  def _header(self, kind: str, label: str, size: int = 0) -> np.ndarray:
    """The first message of every host exchange: each rank's (call, steps, size).

    Every host exchange begins with this one fixed-size gather, so two
    different exchanges that meet (control flow diverged: a collective called
    on one rank only) pair up here and compare their calls, instead of
    pairing their payloads wrongly. Then every rank sees the mismatch alike
    and the job ends with a report naming each rank's call (`_diverged`).

    Returns:
      [ranks, 3] int64: each rank's call digest, steps dispatched and `size`.
    """
    header = np.zeros((self.size, 3), np.int64)
    mine = np.array([_call_digest(kind, label), self.watchdog.step, size], np.int64)
    self._wait(self.comm.Iallgather(mine, header), label)
    if len(set(header[:, 0].tolist())) > 1:
      self._diverged(label)
    self._check_steps(header[:, 1], label)
    return header

  def _diverged(self, label: str) -> None:
    """Ends the job with a report: the ranks are in different host exchanges.

    Every rank gets here from the same header exchange, so they can still
    exchange what each one is calling, and where (a plain gather every rank
    enters alike). Every rank runs its abort hooks (`jdist.timeline` writes
    its part), then rank 0 reports and aborts the job; the others wait for
    it, and report themselves if it does not end the job.

    Raises:
      jdist.errors.WorldMismatchError: only if the abort returns (tests).
    """
    frame = sys._getframe(1)  # pylint: disable=protected-access
    mine = {"rank": self.rank, "label": label, "where": stall_report.user_location(frame),
            "steps": self.watchdog.step, "host": self.watchdog.host_exchanges,
            "flight": flight_recorder.summary()}
    sizes = np.zeros(self.size, np.int64)
    payload = pickle.dumps(mine)
    what = "jdist: comparing the ranks' diverged calls"
    self._wait(self.comm.Iallgather(np.array([len(payload)], np.int64), sizes), what)
    out = np.empty(int(sizes.sum()), np.uint8)
    displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    self._wait(self.comm.Iallgatherv(np.frombuffer(payload, np.uint8),
                                     [out, sizes, displacements, self.MPI.BYTE]), what)
    calls = {rank: pickle.loads(out[d:d + s].tobytes())
             for rank, (d, s) in enumerate(zip(displacements, sizes))}
    report = flight_report.with_section(stall_report.describe_diverged_calls(self.rank, calls),
                                        calls, self.rank, self.size)
    flight_recorder.run_abort_hooks()  # e.g. jdist.timeline: every rank writes its part...
    ends = np.zeros(self.size, np.int64)
    self._wait(self.comm.Iallgather(np.zeros(1, np.int64), ends), what)  # ...before any abort
    if self.rank != 0:
      time.sleep(_REPORTER_GRACE_S)  # rank 0 reports and ends the job
    abort.abort_job(self.watchdog.comm, report, self.rank)
    raise errors.WorldMismatchError(report)

  def barrier(self, label: str = "barrier") -> None:
    self._header("barrier", label)

  def allgather_bytes(self, payload: bytes, label: str) -> list[bytes]:
    # One exchange for the calls, the ranks' step counts (checked alike everywhere) and sizes.
    header = self._header("allgather", label, len(payload))
    sizes = np.ascontiguousarray(header[:, 2])
    out = np.empty(int(sizes.sum()), np.uint8)
    displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    self._wait(self.comm.Iallgatherv(np.frombuffer(payload, np.uint8),
                                     [out, sizes, displacements, self.MPI.BYTE]), label)
    return [out[d:d + s].tobytes() for d, s in zip(displacements, sizes)]

  def allgather_object(self, obj: Any, label: str) -> list[Any]:
    return [pickle.loads(b) for b in self.allgather_bytes(pickle.dumps(obj), label)]

  def bcast_array(self, array: np.ndarray, root: int, label: str) -> np.ndarray:
    self._header("bcast", label, array.nbytes)
    buffer = np.ascontiguousarray(array) if self.rank == root else np.empty_like(array)
    self._wait(self.comm.Ibcast(buffer, root=root), label)
    return buffer

  def allreduce_array(self, array: np.ndarray, label: str) -> np.ndarray:
    self._header("allreduce", label, array.nbytes)
    out = np.empty_like(array)
    self._wait(self.comm.Iallreduce(np.ascontiguousarray(array), out,
                                    op=self.MPI.SUM), label)
    return out

  def abort(self, code: int = 1) -> None:
    """Ends every rank with exit `code`, after what this rank has printed (`abort.end_quietly`)."""
    abort.end_quietly(self.watchdog.comm, self.rank)
    self.comm.Abort(code)


def start(timeout: float, init_timeout: float, launcher_rank: int = 0, *,
          jax_distributed_runtime: bool = True, xla_collectives: bool = False) -> MpiWorld:
  """Initializes MPI and returns the world (`jdist.runtime.job.start` calls it once).

  Then, with `jax_distributed_runtime`, JAX's distributed runtime, so that
  `jax.process_index()` is this MPI rank (`jdist.runtime.jax_distributed`).

  Args:
    timeout: seconds an exchange may wait (the watchdog's deadline).
    init_timeout: seconds every rank has to start MPI and reach this call.
    launcher_rank: this process's rank as the launcher set it, for messages
      printed before MPI knows it.
    jax_distributed_runtime: whether to start JAX's distributed runtime.
    xla_collectives: whether XLA's CPU client gets JAX's cross-process
      collectives (Gloo) with it; by default it gets none
      (`jax_distributed.keep_cpu_collectives_local`).

  Raises:
    jdist.errors.InitOrderError: JAX's backends exist already, so its
      distributed runtime cannot start.
    jdist.errors.CoordinatorError: JAX's coordinator was not reached in time.
  """
  world = MpiWorld(_import_mpi_within(init_timeout, launcher_rank), timeout, init_timeout)
  if jax_distributed_runtime:
    jax_distributed.start(world, xla_collectives=xla_collectives)
  return world
