"""Moving 1-D buffers across every replica, inside a pmapped step.

Three primitives, each over all replicas (local devices, then processes):
`sum_all` (full precision), `sum_all_16bit` (16-bit payload, float32
accumulation) and `gather_all` (replica-ordered all-gather).

The route across processes depends on the topology:

  * "local": one process, or backend "jax" (JAX's multi-process runtime):
    XLA collectives over `DATA_AXIS` already span every replica.
  * "mpi4jax": one device per process: mpi4jax collectives inside the step
    (zero-copy on CPU; mpi4jax's ordered effects allow only one device).
  * "native": several devices per process: one XLA FFI custom call per
    exchange and device into jdist's C++ engine, which reduces the local
    devices' parts and runs MPI across processes without blocking any XLA
    thread (see `jdist.collectives.native`).
  * "callback": the fallback for several devices where the native library
    is not built. Hierarchical: the devices first reduce-scatter the buffer
    locally (XLA), then device d of every process exchanges its 1/D shard on
    its own communicator through a host callback running mpi4py, then the
    devices all-gather the shards.

`JDIST_ROUTE=callback|native` forces a route (benchmarks compare them).
16-bit buffers cross processes as uint16 bit patterns (MPI has no float16
sum): a reduce-scatter, float32 accumulation, an all-gather.

Every call records the bytes this process sends across processes in the
active `measure()` ledger, by the bandwidth-optimal algorithm's count: an
all-reduce of b bytes sends 2(P-1)/P*b per process, an all-gather of b bytes
per process sends (P-1)*b.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdist.runtime import topology as topology_lib
from jdist.collectives import native
from jdist.collectives import payloads
from jdist.collectives import steps
from jdist.runtime import world as world_lib

DATA_AXIS = "data"
ROUTE_ENV = "JDIST_ROUTE"  # force "callback" or "native" (benchmarks)
ROUTES = ("local", "mpi4jax", "native", "callback")


@dataclasses.dataclass
class WireLedger:
  """Bytes and MPI calls this process sends across processes per step."""
  bytes: int = 0
  calls: int = 0


_ledger: contextvars.ContextVar[WireLedger | None] = contextvars.ContextVar(
    "jdist_wire_ledger", default=None)


@contextlib.contextmanager
def measure():
  """Collects the cross-process traffic of the collectives traced inside."""
  ledger = WireLedger()
  token = _ledger.set(ledger)
  try:
    yield ledger
  finally:
    _ledger.reset(token)


def _record(nbytes: float, calls: int) -> None:
  ledger = _ledger.get()
  if ledger is not None:
    ledger.bytes += int(round(nbytes))
    ledger.calls += calls


# Set while a global (jit) step's reduction is traced (see `context.per_process`).
# Such steps are dispatched by the user's own jax.jit, with no bound on the
# executions in flight; the native engine names an exchange by its ordinal and
# a per-device call count, which assumes a device runs one execution of a step
# at a time. Measured: the jit quickstart in 2x2 hung or aborted in 3 of 3 runs
# on the native route and passed on the callback route, so these take it.
_global_step_exchange: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "jdist_global_step_exchange", default=False)


@contextlib.contextmanager
def global_step_exchange():
  """Marks the reductions traced inside as a global (jit) step's."""
  token = _global_step_exchange.set(True)
  try:
    yield
  finally:
    _global_step_exchange.reset(token)


def route(topo=None) -> str:
  """How buffers cross processes for this topology (see module doc).

  Raises:
    ValueError: `JDIST_ROUTE` names an unknown route, or "native" where the
      native engine is not running.
  """
  topo = topo or topology_lib.current()
  if topo.process_count == 1 or topo.backend == "jax":
    return "local"
  forced = os.environ.get(ROUTE_ENV)
  if forced == "callback":
    return "callback"
  if forced == "native":
    if not native.running():
      raise ValueError(f"{ROUTE_ENV}=native, but the native exchange is not available: "
                       f"{native.unavailable_reason() or 'jdist.init() did not start it'}")
    return "native"
  if forced not in (None, ""):
    raise ValueError(f"{ROUTE_ENV}={forced!r}: choose 'native' or 'callback'.")
  if topo.local_device_count == 1:
    return "mpi4jax"
  if _global_step_exchange.get():
    return "callback"
  return "native" if native.running() else "callback"


def _pad_to(buffer: jax.Array, multiple: int) -> jax.Array:
  extra = -buffer.shape[0] % multiple
  return jnp.pad(buffer, (0, extra)) if extra else buffer


def _bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x, jnp.uint16)


def _from_bits(x: jax.Array, dtype) -> jax.Array:
  return lax.bitcast_convert_type(x, dtype)


# Host side of the "callback" route: runs on XLA's device threads, one per
# local device, each on its own communicator.

def _host_allreduce(shard: np.ndarray, device: np.ndarray) -> np.ndarray:
  world = world_lib.get()
  out = np.empty_like(shard)
  world.device_comm(int(device)).Allreduce(np.ascontiguousarray(shard), out,
                                           op=world.MPI.SUM)
  return out


def _host_allgather(piece: np.ndarray, device: np.ndarray) -> np.ndarray:
  world = world_lib.get()
  out = np.empty((world.size,) + piece.shape, piece.dtype)
  world.device_comm(int(device)).Allgather(np.ascontiguousarray(piece), out)
  return out


def _host_sum16(bits: np.ndarray, is_bf16: np.ndarray, device: np.ndarray) -> np.ndarray:
  """Sums uint16-coded 16-bit floats over processes, accumulating in float32."""
  world = world_lib.get()
  comm = world.device_comm(int(device))
  dtype = np.dtype(jnp.bfloat16) if int(is_bf16) else np.dtype(np.float16)
  chunks = bits.reshape(world.size, -1)
  received = np.empty_like(chunks)
  comm.Alltoall(np.ascontiguousarray(chunks), received)
  mine = received.view(dtype).astype(np.float32).sum(axis=0).astype(dtype).view(np.uint16)
  out = np.empty_like(chunks)
  comm.Allgather(mine, out)
  return out.reshape(bits.shape)


# On the callback route each device's host callback blocks an XLA thread in
# MPI, so the exchanges of one step must run in one order on every device of
# every process: XLA:CPU runs independent operations in whatever order they
# become ready, and device 0 of process A waiting in exchange X's local
# all-gather for device 1, itself in exchange Y's MPI call waiting for process
# B, where the roles are swapped, is a deadlock (seen in 2x2 with a flag
# all-reduce beside a top-K all-gather). `steps.chain_input` makes each
# exchange's input depend on the previous exchange's output in the trace.
_after_previous_exchange = steps.chain_input
_exchange_done = steps.chain_output


def _native(kind: int, buffer: jax.Array, result: jax.ShapeDtypeStruct) -> jax.Array:
  return native.call(kind, buffer, result, steps.next_ordinal(), DATA_AXIS)


def _native_sum(buffer: jax.Array) -> jax.Array:
  """Sum over every replica through the native engine, any numeric dtype."""
  dtype = buffer.dtype
  if buffer.size == 0:
    return buffer
  if np.dtype(dtype) in native.SUM_DTYPES:
    return _native(native.SUM, buffer, jax.ShapeDtypeStruct(buffer.shape, dtype))
  if jnp.issubdtype(dtype, jnp.complexfloating):  # a sum of (real, imag) pairs
    parts = jnp.stack([buffer.real, buffer.imag], axis=-1).reshape(-1)
    summed = _native_sum(parts).reshape(-1, 2)
    return lax.complex(summed[:, 0], summed[:, 1]).astype(dtype)
  if jnp.issubdtype(dtype, jnp.floating):  # float8 and friends: in float32
    return _native_sum(buffer.astype(jnp.float32)).astype(dtype)
  wide = jnp.int64 if jnp.dtype(dtype).itemsize == 8 else jnp.int32
  return _native_sum(buffer.astype(wide)).astype(dtype)  # bools, small ints


def _callback(host_fn, result: jax.ShapeDtypeStruct, *args):
  device = lax.axis_index(DATA_AXIS)

  def on_host(*arrays):
    # pure_callback passes jax.Arrays; any JAX op on them (even a reshape)
    # would start a computation from inside this step and can deadlock.
    return host_fn(*(np.asarray(a) for a in arrays))

  return jax.pure_callback(on_host, result, *args, device, vmap_method="sequential")


def sum_all(buffer: jax.Array) -> jax.Array:
  """Sum of a 1-D buffer over every replica, in the buffer's dtype."""
  topo = topology_lib.current()
  which = route(topo)
  if which != "local" and buffer.dtype in payloads.HALF_DTYPES:
    return sum_all_16bit(buffer)  # MPI has no 16-bit float sum
  if which == "local":
    if topo.process_count > 1:
      _record(2 * (topo.process_count - 1) / topo.process_count * buffer.nbytes, 1)
    return lax.psum(buffer, DATA_AXIS)
  _record(2 * (topo.process_count - 1) / topo.process_count * buffer.nbytes, 1)
  if which == "native":
    return _native_sum(buffer)
  world = world_lib.get()
  if which == "mpi4jax":
    mpi4jax = world_lib.import_mpi4jax()
    return mpi4jax.allreduce(buffer, op=world.MPI.SUM, comm=world.device_comm(0))
  devices = topo.local_device_count
  size = buffer.shape[0]
  shard = _pad_to(_after_previous_exchange(buffer), devices)
  if devices > 1:
    shard = lax.psum_scatter(shard, DATA_AXIS, tiled=True)
  shard = _callback(_host_allreduce, jax.ShapeDtypeStruct(shard.shape, shard.dtype), shard)
  if devices > 1:
    shard = lax.all_gather(shard, DATA_AXIS, tiled=True)
  return _exchange_done(shard[:size])


def _add_rows(rows: jax.Array) -> jax.Array:
  """Float32 sum of the rows of a small [P, m] array.

  Row by row rather than `.sum(axis=0)`: XLA:CPU runs the latter as a strided
  column reduction, measured 80x slower at 16 MB (benchmarks/proposals.py).
  """
  return functools.reduce(jnp.add, [rows[i].astype(jnp.float32) for i in range(rows.shape[0])])


def _local_sum16(buffer: jax.Array, axis_size: int) -> jax.Array:
  """Reduce-scatter of 16-bit values over DATA_AXIS, accumulated in float32."""
  chunks = buffer.reshape(axis_size, -1)
  return _add_rows(lax.all_to_all(chunks, DATA_AXIS, 0, 0))


def sum_all_16bit(buffer: jax.Array) -> jax.Array:
  """Sum over every replica of a float16/bfloat16 buffer.

  Every hop carries 16 bits per value; sums are accumulated in float32 and
  rounded once per hop. The caller pre-divides to keep sums in range.
  """
  dtype = buffer.dtype
  topo = topology_lib.current()
  which = route(topo)
  size = buffer.shape[0]
  if topo.process_count > 1:
    _record(2 * (topo.process_count - 1) / topo.process_count * buffer.nbytes, 2)
  if which == "local":
    axis_size = lax.axis_size(DATA_AXIS)
    if axis_size == 1:
      return buffer
    padded = _pad_to(buffer, axis_size)
    shard = _local_sum16(padded, axis_size).astype(dtype)
    return lax.all_gather(shard, DATA_AXIS, tiled=True)[:size]
  if which == "native":
    if size == 0:
      return buffer
    return _native(native.SUM16, buffer, jax.ShapeDtypeStruct(buffer.shape, dtype))
  world = world_lib.get()
  processes = topo.process_count
  if which == "mpi4jax":
    mpi4jax = world_lib.import_mpi4jax()
    chunks = _bits(_pad_to(buffer, processes).reshape(processes, -1))
    received = mpi4jax.alltoall(chunks, comm=world.device_comm(0))
    mine = _add_rows(_from_bits(received, dtype)).astype(dtype)
    gathered = mpi4jax.allgather(_bits(mine), comm=world.device_comm(0))
    return _from_bits(gathered, dtype).reshape(-1)[:size]
  devices = topo.local_device_count
  padded = _pad_to(_after_previous_exchange(buffer), devices * processes)
  shard = _local_sum16(padded, devices).astype(dtype) if devices > 1 else padded
  is_bf16 = np.int32(dtype == jnp.bfloat16)
  shard_bits = _callback(_host_sum16, jax.ShapeDtypeStruct(shard.shape, jnp.uint16),
                         _bits(shard), is_bf16)
  shard = _from_bits(shard_bits, dtype)
  if devices > 1:
    shard = lax.all_gather(shard, DATA_AXIS, tiled=True)
  return _exchange_done(shard[:size])


def gather_all(buffer: jax.Array) -> jax.Array:
  """Every replica's 1-D buffer, stacked in global replica order: [R, n]."""
  topo = topology_lib.current()
  which = route(topo)
  processes, devices = topo.process_count, topo.local_device_count
  if processes > 1:
    _record((processes - 1) * devices * buffer.nbytes, 1)
  if which == "local":
    return lax.all_gather(buffer, DATA_AXIS)
  if which == "native":
    return _native(native.GATHER, buffer,
                   jax.ShapeDtypeStruct((processes * devices,) + buffer.shape, buffer.dtype))
  world = world_lib.get()
  if which == "mpi4jax":
    mpi4jax = world_lib.import_mpi4jax()
    return mpi4jax.allgather(buffer, comm=world.device_comm(0))
  per_process = _callback(
      _host_allgather, jax.ShapeDtypeStruct((processes,) + buffer.shape, buffer.dtype),
      _after_previous_exchange(buffer))
  if devices == 1:
    return _exchange_done(per_process)
  stacked = lax.all_gather(per_process, DATA_AXIS)  # [D, P, n]
  return _exchange_done(
      jnp.swapaxes(stacked, 0, 1).reshape((processes * devices,) + buffer.shape))
