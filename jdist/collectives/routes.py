"""Routes: how 1-D buffers cross every replica inside a step, one object each.

Every route offers three primitives over all replicas (local devices, then
processes): `sum_all` (full precision), `sum_all_16bit` (16-bit payload,
float32 accumulation) and `gather_all` (replica-ordered all-gather), and
records the bytes they send across processes (`jdist.collectives.wire`).
A route that crosses processes runs each exchange as the lowering of one JAX
primitive (`jdist.collectives.autodiff`), so `jax.grad`, `jax.jvp`,
`jax.vmap` and `lax.scan` work through it as through `lax.psum`; the base
class and the 16-bit helpers are in `route_base`.

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

import functools
import os
import warnings

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jdist.collectives import autodiff
from jdist.collectives import native
from jdist.collectives.route_base import (  # pylint: disable=unused-import
    Route, add_rows, bits, from_bits, local_sum16, pad_to)
from jdist.collectives import steps
from jdist.collectives import wire
from jdist.collectives.wire import DATA_AXIS
from jdist.runtime import flight_recorder
from jdist.runtime import world as world_lib
from jdist.runtime import xla_cpu

ROUTE_ENV = "JDIST_ROUTE"  # the default of jdist.init(route=...)
ROUTES = ("local", "mpi4jax", "native", "callback")


class LocalRoute(Route):
  """XLA collectives over `DATA_AXIS`, which span every replica."""

  name = "local"

  def sum_all(self, buffer: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
    if self.processes > 1:  # backend "jax": XLA's collectives cross processes
      wire.record(2 * (self.processes - 1) / self.processes * buffer.nbytes, 1)
    return lax.psum(buffer, axis)

  def _exchange(self, kind: str, buffer: jax.Array, axis: str) -> jax.Array:
    # XLA's collectives: differentiable and batchable as they are.
    return self.lower(kind, buffer, -1, axis)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    return lax.psum(buffer, axis)

  def _sum16(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    axis_size = lax.axis_size(axis)
    if axis_size == 1:
      return buffer
    padded = pad_to(buffer, axis_size)
    shard = local_sum16(padded, axis_size, axis).astype(buffer.dtype)
    return lax.all_gather(shard, axis, tiled=True)[:buffer.shape[0]]

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    return lax.all_gather(buffer, axis)


class Mpi4jaxRoute(Route):
  """mpi4jax collectives on the world's device communicator 0 (one device each)."""

  name = "mpi4jax"

  def __init__(self, topology, world):
    super().__init__(topology)
    self.world = world

  def _comm(self):
    return self.world.device_comm(0)

  @functools.cache  # pylint: disable=method-cache-max-size-none
  def effects(self):
    """mpi4jax's ordered effect, read from a traced call (it has no public name)."""
    probe = jax.ShapeDtypeStruct((1,), jnp.float32)
    return frozenset(jax.make_jaxpr(lambda x: self._sum(x, -1, DATA_AXIS))(probe).effects)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    mpi4jax = world_lib.import_mpi4jax()
    return mpi4jax.allreduce(buffer, op=self.world.MPI.SUM, comm=self._comm())

  def _sum16(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    mpi4jax = world_lib.import_mpi4jax()
    dtype, processes = buffer.dtype, self.processes
    chunks = bits(pad_to(buffer, processes).reshape(processes, -1))
    received = mpi4jax.alltoall(chunks, comm=self._comm())
    mine = add_rows(from_bits(received, dtype)).astype(dtype)
    gathered = mpi4jax.allgather(bits(mine), comm=self._comm())
    return from_bits(gathered, dtype).reshape(-1)[:buffer.shape[0]]

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    return world_lib.import_mpi4jax().allgather(buffer, comm=self._comm())


class NativeRoute(Route):
  """jdist's C++ engine, one FFI custom call per exchange and device."""

  name = "native"

  def join(self, buffers: list[jax.Array]) -> list[jax.Array]:
    """Every reduced bucket, read only once all of them are: lets the exchanges
    run beside the rest of the backward pass (`native.join`)."""
    return native.join(buffers)

  def process_index_value(self) -> jax.Array:
    """Read at run time on CPU (no literal in the program at all), else behind a barrier."""
    value = native.process_index_value()
    return super().process_index_value() if value is None else value

  def _call(self, kind: int, buffer: jax.Array, result: jax.ShapeDtypeStruct,
            ordinal: int, axis: str) -> jax.Array:
    return native.call(kind, buffer, result, ordinal, axis)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    """Any numeric dtype: those the engine sums directly, others through them."""
    dtype = buffer.dtype
    if buffer.size == 0:
      return buffer
    if np.dtype(dtype) in native.SUM_DTYPES:
      return self._call(native.SUM, buffer, jax.ShapeDtypeStruct(buffer.shape, dtype), ordinal,
                        axis)
    if jnp.issubdtype(dtype, jnp.complexfloating):  # a sum of (real, imag) pairs
      parts = jnp.stack([buffer.real, buffer.imag], axis=-1).reshape(-1)
      summed = self._sum(parts, ordinal, axis).reshape(-1, 2)
      return lax.complex(summed[:, 0], summed[:, 1]).astype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):  # float8 and friends: in float32
      return self._sum(buffer.astype(jnp.float32), ordinal, axis).astype(dtype)
    wide = jnp.int64 if jnp.dtype(dtype).itemsize == 8 else jnp.int32
    return self._sum(buffer.astype(wide), ordinal, axis).astype(dtype)  # bools, small ints

  def _sum16(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    if buffer.shape[0] == 0:
      return buffer
    return self._call(native.SUM16, buffer, jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
                      ordinal, axis)

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    return self._call(native.GATHER, buffer,
                      jax.ShapeDtypeStruct((self.replicas,) + buffer.shape, buffer.dtype),
                      ordinal, axis)


# On the callback route each device's host callback blocks an XLA thread in
# MPI, so the exchanges of one step must run in one order on every device of
# every process: XLA:CPU runs independent operations in whatever order they
# become ready, and device 0 of process A waiting in exchange X's local
# all-gather for device 1, itself in exchange Y's MPI call waiting for process
# B, where the roles are swapped, is a deadlock (seen in 2x2 with a flag
# all-reduce beside a top-K all-gather). `steps.chain_input` makes each
# exchange's input depend on the previous exchange's output in the trace
# (`chained`: `autodiff.exchange` does it around the exchange's primitive).
after_previous_exchange = steps.chain_input
exchange_done = steps.chain_output


def host_callback(host_fn, axis: str, result: jax.ShapeDtypeStruct, *args):
  """`host_fn(*args, device)` on the host, per device of `axis`, inside the step."""
  device = lax.axis_index(axis)

  def on_host(*arrays):
    # pure_callback passes jax.Arrays; any JAX op on them (even a reshape)
    # would start a computation from inside this step and can deadlock.
    return host_fn(*(np.asarray(a) for a in arrays))

  return jax.pure_callback(on_host, result, *args, device, vmap_method="sequential")


class CallbackRoute(Route):
  """Host callbacks running mpi4py, device d of every process on `device_comm(d)`.

  The host side runs on XLA's device threads, one per local device, each on
  its own communicator.
  """

  name = "callback"
  chained = True

  def __init__(self, topology, world):
    super().__init__(topology)
    self.world = world

  def _recorded(self, host_fn, kind: str, ordinal: int, buffer: jax.Array):
    """`host_fn` (its last argument the device), in the flight recorder."""
    nbytes, devices = buffer.nbytes, self.devices

    def run(*args):
      key = flight_recorder.device_posted(int(args[-1]), ordinal, kind, nbytes, devices)
      try:
        return host_fn(*args)
      finally:
        flight_recorder.device_done(key)
    return run

  def _host_allreduce(self, shard: np.ndarray, device: np.ndarray) -> np.ndarray:
    out = np.empty_like(shard)
    self.world.device_comm(int(device)).Allreduce(np.ascontiguousarray(shard), out,
                                                  op=self.world.MPI.SUM)
    return out

  def _host_allgather(self, piece: np.ndarray, device: np.ndarray) -> np.ndarray:
    out = np.empty((self.world.size,) + piece.shape, piece.dtype)
    self.world.device_comm(int(device)).Allgather(np.ascontiguousarray(piece), out)
    return out

  def _host_sum16(self, coded: np.ndarray, is_bf16: np.ndarray,
                  device: np.ndarray) -> np.ndarray:
    """Sums uint16-coded 16-bit floats over processes, accumulating in float32."""
    comm = self.world.device_comm(int(device))
    dtype = np.dtype(jnp.bfloat16) if int(is_bf16) else np.dtype(np.float16)
    chunks = coded.reshape(self.world.size, -1)
    received = np.empty_like(chunks)
    comm.Alltoall(np.ascontiguousarray(chunks), received)
    mine = received.view(dtype).astype(np.float32).sum(axis=0).astype(dtype).view(np.uint16)
    out = np.empty_like(chunks)
    comm.Allgather(mine, out)
    return out.reshape(coded.shape)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    devices, size = self.devices, buffer.shape[0]
    shard = pad_to(buffer, devices)
    if devices > 1:
      shard = lax.psum_scatter(shard, axis, tiled=True)
    shard = host_callback(self._recorded(self._host_allreduce, autodiff.SUM, ordinal, buffer),
                          axis, jax.ShapeDtypeStruct(shard.shape, shard.dtype), shard)
    if devices > 1:
      shard = lax.all_gather(shard, axis, tiled=True)
    return shard[:size]

  def _sum16(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    dtype, devices, size = buffer.dtype, self.devices, buffer.shape[0]
    padded = pad_to(buffer, devices * self.processes)
    shard = local_sum16(padded, devices, axis).astype(dtype) if devices > 1 else padded
    is_bf16 = np.int32(dtype == jnp.bfloat16)
    shard_bits = host_callback(self._recorded(self._host_sum16, autodiff.SUM16, ordinal, buffer),
                               axis, jax.ShapeDtypeStruct(shard.shape, jnp.uint16),
                               bits(shard), is_bf16)
    shard = from_bits(shard_bits, dtype)
    if devices > 1:
      shard = lax.all_gather(shard, axis, tiled=True)
    return shard[:size]

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    processes, devices = self.processes, self.devices
    per_process = host_callback(
        self._recorded(self._host_allgather, autodiff.GATHER, ordinal, buffer), axis,
        jax.ShapeDtypeStruct((processes,) + buffer.shape, buffer.dtype),
        buffer)
    if devices == 1:
      return per_process
    stacked = lax.all_gather(per_process, axis)  # [D, P, n]
    return jnp.swapaxes(stacked, 0, 1).reshape((processes * devices,) + buffer.shape)


def _start_native(topology, world) -> None:
  """Starts the native engine where it serves (collective: every process alike)."""
  why_not = native.start(world, topology.local_device_count, topology.timeout)
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
    if not native.running():
      raise ValueError(f"{label}, but the native exchange is not available: "
                       f"{native.unavailable_reason() or 'jdist.init() did not start it'}. "
                       f"Build it with `python -m jdist.collectives.native.build`, or "
                       f"choose 'callback' or None.")
    return NativeRoute(topology)
  if not native.running() or (one_device and native.platform_of_devices() != "cpu"):
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
      and int(threads) < xla_cpu.MIN_HOST_THREADS and native.platform_of_devices() == "cpu"):
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
