"""jdist's native exchange: an XLA FFI custom call into a small C++ engine, and its route.

The route across processes for several devices per process (`NativeRoute`,
`"native"` in `jdist.collectives.route()`), the default wherever the engine
runs. Each exchange of a step is one custom call per
device (`jax.ffi.ffi_call(..., has_side_effect=True)`, no JAX effect, so it
is accepted in a multi-device pmap). The handler does not block: it hands its
device's buffer to the engine and returns an XLA future. Once every local
device has posted, the engine reduces the parts in C++ and runs the
cross-process part with non-blocking MPI on a communicator of its own, tagged
by the exchange's ordinal (its position in the step, fixed when the step is
traced; see `jdist.collectives.routes.base`). Since no device thread waits inside
an exchange, exchanges may complete in any order, inside `lax.cond` branches
as well, without the deadlocks of blocking host callbacks.

Across several nodes with several processes on each (as many on every
node), sums are node-aware: each segment is reduce-scattered within the
node, its node-chunk reduce-scattered and all-gathered among the processes
of the same local rank on the other nodes, then all-gathered within the
node, so each node's link carries the sum once per direction instead of
once per process on it (`JDIST_NATIVE_HIERARCHY=auto|on|off`; see
`hierarchy_nodes`).

The libraries are built by `python -m jdist.collectives.native.build`
(scripts/install.sh runs it) against the MPI of mpi4py and the installed
jaxlib's FFI headers. Without them jdist falls back to the callback route.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdist.collectives.routes.base import Route
from jdist.runtime import flight_recorder
from jdist.runtime import topology

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD_DIR = os.path.join(HERE, "_build")  # written by `build`, ignored by git
CPU_LIBRARY = os.path.join(BUILD_DIR, "libjdist_exchange.so")
CUDA_LIBRARY = os.path.join(BUILD_DIR, "libjdist_exchange_cuda.so")
TARGET = "jdist_exchange"
JOIN_TARGET = "jdist_join"
PROCESS_INDEX_TARGET = "jdist_process_index"
SUM, SUM16, GATHER = 0, 1, 2  # engine.h's JdistKind
HIERARCHY_ENV = "JDIST_NATIVE_HIERARCHY"  # auto (default), on or off
NODE_MAP_ENV = "JDIST_NATIVE_NODE_MAP"  # each rank's node, "0,0,1,1": emulates nodes (tests)
SUM_DTYPES = frozenset(np.dtype(d) for d in (np.float32, np.float64, np.int32, np.int64,
                                              np.uint32))

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_registered: set[str] = set()
_unavailable: str | None = None  # why the route cannot be used, once known
_started = False


def _load() -> ctypes.CDLL:
  """Loads the CPU library (once) and declares its C interface.

  Raises:
    OSError: the library is missing or cannot be loaded.
  """
  global _library
  if _library is None:
    if not os.path.exists(CPU_LIBRARY):
      raise OSError(f"{CPU_LIBRARY} is not built (run `python -m "
                    f"jdist.collectives.native.build`; scripts/install.sh does)")
    library = ctypes.CDLL(CPU_LIBRARY)
    library.jdist_start.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_double,
                                    ctypes.POINTER(ctypes.c_int)]
    library.jdist_start.restype = ctypes.c_int
    library.jdist_hierarchical.restype = ctypes.c_int
    library.jdist_set_hierarchical.argtypes = [ctypes.c_int]
    library.jdist_set_hierarchical.restype = ctypes.c_int
    library.jdist_last_error.restype = ctypes.c_char_p
    library.jdist_completed.restype = ctypes.c_int64
    library.jdist_segments_completed.restype = ctypes.c_int64
    library.jdist_set_segment_bytes.argtypes = [ctypes.c_int64]
    library.jdist_set_segment_bytes.restype = ctypes.c_int64
    library.jdist_running.restype = ctypes.c_int
    library.jdist_trace_take.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    library.jdist_trace_take.restype = ctypes.c_int64
    library.jdist_trace_enable.argtypes = [ctypes.c_int]
    library.jdist_trace_enable.restype = ctypes.c_int
    library.jdist_flight_snapshot.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    library.jdist_flight_snapshot.restype = ctypes.c_int64
    library.jdist_set_process_index.argtypes = [ctypes.c_int]
    _library = library
  return _library


def _register(platform: str) -> None:
  """Registers the FFI handler for `platform` ("cpu" or "cuda") with XLA."""
  if platform in _registered:
    return
  if platform == "cpu":
    handler = _load().JdistExchangeCpu
    jax.ffi.register_ffi_target(JOIN_TARGET, jax.ffi.pycapsule(_load().JdistJoinCpu),
                                platform="cpu")
    jax.ffi.register_ffi_target(PROCESS_INDEX_TARGET,
                                jax.ffi.pycapsule(_load().JdistProcessIndexCpu), platform="cpu")
  else:
    if not os.path.exists(CUDA_LIBRARY):
      raise OSError(f"{CUDA_LIBRARY} is not built (no CUDA toolkit at build time)")
    _load()  # the CUDA library links to the CPU one
    handler = ctypes.CDLL(CUDA_LIBRARY).JdistExchangeCuda
  jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler),
                              platform="cpu" if platform == "cpu" else "CUDA")
  _registered.add(platform)


def platform_of_devices() -> str:
  """The local devices' platform as the FFI names it: "cpu", "cuda", ..."""
  platform = jax.local_devices()[0].platform
  return {"gpu": "cuda"}.get(platform, platform)


def node_map(hosts: list[str]) -> list[int]:
  """Each rank's node index: `$JDIST_NATIVE_NODE_MAP` ("0,0,1,1") where set,
  else from the ranks' host names (`jdist.runtime.topology.nodes_of`).

  Raises:
    ValueError: the map's length is not the number of ranks.
  """
  override = os.environ.get(NODE_MAP_ENV, "").strip()
  if not override:
    return topology.nodes_of(hosts)
  nodes = [int(node) for node in override.split(",")]
  if len(nodes) != len(hosts):
    raise ValueError(f"{NODE_MAP_ENV}={override!r} names {len(nodes)} ranks' nodes; the job "
                     f"has {len(hosts)} ranks.")
  return nodes


def hierarchy_nodes(nodes: list[int], mode: str | None = None) -> list[int] | None:
  """The node map that makes sums node-aware, or None for flat sums.

  Args:
    nodes: each rank's node index.
    mode: "auto" (default; `$JDIST_NATIVE_HIERARCHY` where None): node-aware
      when the job spans several nodes, some node has several processes and
      every node has as many; "on": node-aware whenever every node has as
      many processes (on one node too: a test of the four phases); "off": flat.

  Raises:
    ValueError: an unknown mode.
  """
  mode = (mode if mode is not None else os.environ.get(HIERARCHY_ENV, "auto")).strip() or "auto"
  if mode not in ("auto", "on", "off"):
    raise ValueError(f"{HIERARCHY_ENV}={mode!r}: choose 'auto', 'on' or 'off'.")
  per_node = collections.Counter(nodes).values()
  even = len(set(per_node)) == 1 and sorted(set(nodes)) == list(range(len(per_node)))
  if mode == "off" or not even:
    if mode == "on":
      warnings.warn(f"jdist: {HIERARCHY_ENV}=on, but the nodes hold different numbers of "
                    f"processes ({sorted(per_node)}): sums stay flat.", RuntimeWarning)
    return None
  if mode == "auto" and (len(per_node) < 2 or max(per_node) < 2):
    return None
  return list(nodes)


def start(world, local_devices: int, timeout: float) -> str | None:
  """Starts the engine on a duplicate of `world.comm`; returns why not, or None.

  Collective over the processes (the engine duplicates the communicator):
  every process calls it once, from `jdist.init`, after the world has every
  rank's host name (`world.hosts`, for `node_map` and `hierarchy_nodes`).

  Args:
    world: the `MpiWorld`.
    local_devices: devices per process (parts per exchange).
    timeout: the job's exchange deadline in seconds; the engine aborts the
      job when an exchange waits about twice that long (a backstop behind
      the watchdog, which reports first).
  """
  global _started, _unavailable
  with _lock:
    if _started:
      return None
    # Decide first, identically on every process (same build, same platform),
    # so that either all or none of them enter the collective start below.
    try:
      platform = platform_of_devices()
      if platform not in ("cpu", "cuda"):
        raise OSError(f"no native exchange for {platform} devices")
      _register(platform)
      library = _load()
    except (OSError, AttributeError) as err:
      _unavailable = str(err)
      return _unavailable
    nodes = hierarchy_nodes(node_map(world.hosts))
    node_array = (ctypes.c_int * len(nodes))(*nodes) if nodes else None
    if library.jdist_start(world.comm.py2f(), local_devices, 2 * timeout + 30,
                           node_array) != 0:
      _unavailable = library.jdist_last_error().decode()
      return _unavailable
    library.jdist_set_process_index(world.comm.Get_rank())
    session = world.comm.bcast(1 + int.from_bytes(os.urandom(3), "big"))  # deferred's tokens
    getattr(library, "jdist_deferred_set_session", lambda _: None)(session)  # an older build
    _started = True
    flight_recorder.add_source(flight_rows)
    # After the steps in flight at exit end (they post to the engine), before
    # MPI_Finalize; a plain atexit hook would run first and strand them.
    world.on_exit(stop)
    return None


def stop() -> None:
  """Stops the engine thread (before MPI is finalized)."""
  global _started
  with _lock:
    if _started and _library is not None:
      _library.jdist_stop()
    _started = False


def running() -> bool:
  return _started


def hierarchical() -> bool:
  """Whether the running engine's sums are node-aware (`hierarchy_nodes`)."""
  return bool(_started and _library is not None and _library.jdist_hierarchical())


def set_hierarchical(on: bool) -> bool:
  """Makes the next native sums node-aware or flat; returns the previous setting.

  For measurements and tests: every process must set the same, between
  steps (each sum's segments all cross the way its first one did).

  Raises:
    ValueError: `on` where the engine started flat (a single node, uneven
      nodes, or `JDIST_NATIVE_HIERARCHY=off`: no node map to follow).
    OSError: the native library is missing.
  """
  previous = int(_load().jdist_set_hierarchical(int(bool(on))))
  if previous < 0:
    raise ValueError("the native engine started without a node map (flat sums only): "
                     f"see {HIERARCHY_ENV} and {NODE_MAP_ENV}.")
  return bool(previous)


def unavailable_reason() -> str | None:
  """Why the native route cannot be used in this process, if it was tried."""
  return _unavailable


def completed() -> int:
  """Exchanges the engine completed (0 when it never started)."""
  return int(_library.jdist_completed()) if _library is not None else 0


def segments_completed() -> int:
  """Segments of sums that crossed processes (0 when the engine never started)."""
  return int(_library.jdist_segments_completed()) if _library is not None else 0


def set_segment_bytes(nbytes: int | None) -> int | None:
  """Sets the wire bytes per segment of a native sum; returns the previous value.

  A sum larger than this crosses processes in segments (64 at most), each
  sent as soon as the local devices' parts of it are added, so that MPI moves
  one while the next is still being reduced. Starts from
  `$JDIST_NATIVE_SEGMENT_BYTES`, else the default: 4 MiB for flat sums,
  256 KiB for node-aware ones (their shared-memory phases then overlap the
  other segments' bytes on the node's link). Every process must set the same
  value, between steps (a different one would pair unrelated messages; the
  engine aborts the job on a size mismatch).

  Args:
    nbytes: wire bytes per segment; 0 sends every sum whole; None (or a
      negative value) restores the default.

  Returns:
    The previous setting, None where it was the default.

  Raises:
    OSError: the native library is missing.
  """
  previous = int(_load().jdist_set_segment_bytes(-1 if nbytes is None else int(nbytes)))
  return None if previous < 0 else previous


def join(buffers: list[jax.Array]) -> list[jax.Array]:
  """The same buffers, through one custom call that XLA cannot see through.

  Reading every reduced bucket of a step through one join keeps XLA from
  scheduling a bucket's consumers (and reusing memory for them) between two
  exchanges: on CPU that reuse made the rest of the backward pass wait for
  the first exchange (measured with XLA's thunk graph, docs/communication.md).
  The inputs are aliased to the outputs, so nothing is copied.
  """
  if len(buffers) < 2 or "cpu" not in _registered:
    return list(buffers)
  results = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers]
  # Under jax.vmap every buffer carries the batch axis (aliases need equal shapes).
  return list(jax.ffi.ffi_call(JOIN_TARGET, results, has_side_effect=True,
                               vmap_method="broadcast_all",
                               input_output_aliases={i: i for i in range(len(buffers))})(
      *buffers))


TRACE_ENV = "JDIST_NATIVE_TRACE"
# trace.h's columns: times are CLOCK_MONOTONIC ns, as time.monotonic_ns().
TRACE_COLUMNS = ("ordinal", "call", "kind", "bytes", "first_post_ns", "last_post_ns",
                 "mpi_start_ns", "done_ns")


def take_trace(max_rows: int = 1 << 16) -> np.ndarray:
  """The exchanges completed since the last call, oldest first, and forgets them.

  Recorded only when `JDIST_NATIVE_TRACE` is set before the engine starts.

  Returns:
    int64 array [rows, len(TRACE_COLUMNS)]: each exchange's ordinal, call
    count, kind, bytes, and the monotonic times at which its first and last
    local device posted it, its MPI part started and it completed.
  """
  if _library is None:
    return np.zeros((0, len(TRACE_COLUMNS)), np.int64)
  rows = np.zeros((max_rows, len(TRACE_COLUMNS)), np.int64)
  taken = _library.jdist_trace_take(rows.ctypes.data, max_rows)
  return rows[:taken]


def enable_trace(on: bool) -> bool:
  """Turns the engine's exchange timeline (`take_trace`) on or off; returns
  whether it was on. False when the engine never loaded."""
  if _library is None:
    return False
  return bool(_library.jdist_trace_enable(int(on)))


# flight.h's columns (the engine's flight recorder, always on).
FLIGHT_COLUMNS = ("id", "ordinal", "call", "kind", "bytes", "state", "posted_ns", "wire_ns",
                  "done_ns")
FLIGHT_SLOTS = 256
_KIND_NAMES = ("sum", "sum16", "gather")  # JdistKind, as jdist.collectives.routes.base names them


def flight_snapshot() -> np.ndarray:
  """The engine's flight recorder: its newest rows (FLIGHT_COLUMNS), oldest first."""
  if _library is None:
    return np.zeros((0, len(FLIGHT_COLUMNS)), np.int64)
  rows = np.zeros((FLIGHT_SLOTS, len(FLIGHT_COLUMNS)), np.int64)
  taken = _library.jdist_flight_snapshot(rows.ctypes.data, FLIGHT_SLOTS)
  return rows[:taken]


def flight_rows() -> list[flight_recorder.Entry]:
  """The engine's flight recorder as `flight_recorder.Entry` rows (its source)."""
  return [flight_recorder.Entry(
      ordinal=int(r[1]), call=int(r[2]), kind=_KIND_NAMES[int(r[3])], nbytes=int(r[4]),
      state=flight_recorder.STATES[int(r[5])], posted_ns=int(r[6]), wire_ns=int(r[7]),
      done_ns=int(r[8]), route="native") for r in flight_snapshot()]


def process_index_value() -> jax.Array | None:
  """This process's index as an int32 read at run time, on CPU devices; else None.

  Every process then compiles the same program (see `jdist.collectives.routes.base.rank_value`).
  """
  if not _started or "cpu" not in _registered:
    return None
  return jax.ffi.ffi_call(PROCESS_INDEX_TARGET, jax.ShapeDtypeStruct((), np.int32))()


def call(kind: int, buffer: jax.Array, result: jax.ShapeDtypeStruct, ordinal: int,
         axis_name: str) -> jax.Array:
  """One exchange inside a pmapped step: the custom call on this device.

  Args:
    kind: SUM, SUM16 or GATHER.
    buffer: this device's 1-D (or any shape) input.
    result: the output's shape and dtype (the buffer's for sums; a leading
      replica axis for gathers).
    ordinal: the exchange's position in the step (unique within it, the same
      on every process).
    axis_name: the pmap axis of the local devices.
  """
  device = lax.axis_index(axis_name).astype(np.int32)
  # A sum writes its result over its input: the input's pages are already
  # mapped, while a fresh XLA output buffer page-faults on every call
  # (measured: the copy into it took 7 ms of a 16 MB exchange's 21 ms).
  # The engine reads every input before it writes any output.
  aliases = {1: 0} if kind != GATHER else {}
  return jax.ffi.ffi_call(TARGET, result, has_side_effect=True,
                          input_output_aliases=aliases)(
      device, buffer, ordinal=np.int64(ordinal), kind=np.int32(kind))


class NativeRoute(Route):
  """jdist's C++ engine, one FFI custom call per exchange and device."""

  name = "native"

  def join(self, buffers: list[jax.Array]) -> list[jax.Array]:
    """Every reduced bucket, read only once all of them are: lets the exchanges
    run beside the rest of the backward pass (`join`)."""
    return join(buffers)

  def process_index_value(self) -> jax.Array:
    """Read at run time on CPU (no literal in the program at all), else behind a barrier."""
    value = process_index_value()
    return super().process_index_value() if value is None else value

  def _call(self, kind: int, buffer: jax.Array, result: jax.ShapeDtypeStruct,
            ordinal: int, axis: str) -> jax.Array:
    return call(kind, buffer, result, ordinal, axis)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    """Any numeric dtype: those the engine sums directly, others through them."""
    dtype = buffer.dtype
    if buffer.size == 0:
      return buffer
    if np.dtype(dtype) in SUM_DTYPES:
      return self._call(SUM, buffer, jax.ShapeDtypeStruct(buffer.shape, dtype), ordinal,
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
    return self._call(SUM16, buffer, jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
                      ordinal, axis)

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    return self._call(GATHER, buffer,
                      jax.ShapeDtypeStruct((self.replicas,) + buffer.shape, buffer.dtype),
                      ordinal, axis)
