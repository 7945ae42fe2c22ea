"""Sums that outlive their step: started in one step, finished in a later one.

On the native route (CPU devices, several processes) a sum over every
replica can be split in two custom calls (`jdist/collectives/native/deferred.h`):

* `start(buffer)` copies this device's buffer into memory the engine owns,
  posts it and returns at once a *token*, int32 [ordinal, seq, session]:
  the step ends without waiting for the wire;
* `finish(token, like)` in a later step waits for that exchange (an XLA
  future: no thread is held) and returns the sum.

`jdist.diloco(..., delay=τ)` starts a fragment's pseudo-gradient sum at its
sync step and finishes it τ steps later, so the exchange is on the wire
while the inner steps between compute (see docs/diloco.md).

A token names its exchange exactly: `seq` counts this device's starts of
that ordinal in this process, so several exchanges of one ordinal may be
in flight and each finish reads its own (seq -1 reads the oldest unread
one, first in, first out). A finished exchange is kept until the next
start of its ordinal on that device: a second finish of one token (a state
restored from a checkpoint and continued beside the original) reads the
same sum. `session` is one random value per run of the job, the same on
every process: a token from another run's checkpoint has another session.
`held(token)` tells a step at run time whether a finish would read a sum
(this run's token, still kept), so that a caller holding the shares can
sum them again instead. A finish of a token never
started in this process is an error (not a hang); an exchange that another
process never starts is aborted by the engine's deadline, as any other.

A started sum is a *background* exchange: the native engine sends it in
small segments (64 KiB on the wire by default, `set_segment_bytes`), one at
a time, on a communicator of its own, so that the exchanges of the steps
that run meanwhile (a loss mean of 4 bytes) pass between its segments
instead of queueing behind all of its bytes (head-of-line blocking, see
docs/diloco.md and `jdist/collectives/native/pacing.h`).

At the end of training, an exchange started and never finished still
completes on the wire (every process posted it) and is dropped;
`drain()` waits for such exchanges and frees their memory.
"""

from __future__ import annotations

import ctypes

import jax
import numpy as np
from jax import lax

from jdist.collectives.routes import base
from jdist import errors
from jdist.collectives import context
from jdist.collectives import native
from jdist.collectives import routes
from jdist.collectives.routes.base import DATA_AXIS

START_TARGET = "jdist_deferred_start"
FINISH_TARGET = "jdist_deferred_finish"
SESSION_TARGET = "jdist_deferred_session"
HELD_TARGET = "jdist_deferred_held"
TOKEN_SHAPE = (3,)  # [ordinal, seq, session]; session 0: nothing in flight
# A started sum stays on the wire while later steps run exchanges of their
# own, whose ordinals count from 0 in every step; the engine tags messages by
# ordinal and segment, so deferred sums take ordinals above any step's
# (and below the unscoped ones, `base._UNSCOPED_FIRST`): no two exchanges
# in flight share a tag.
ORDINAL_BASE = 1 << 19
_registered = False


def _library() -> ctypes.CDLL:
  """The CPU library with the deferred handlers registered with XLA (once)."""
  global _registered
  library = native._load()  # pylint: disable=protected-access
  if not _registered:
    library.jdist_deferred_outstanding.restype = ctypes.c_int64
    library.jdist_deferred_drain.argtypes = [ctypes.c_double]
    library.jdist_deferred_drain.restype = ctypes.c_int64
    library.jdist_set_background_segment_bytes.argtypes = [ctypes.c_int64]
    library.jdist_set_background_segment_bytes.restype = ctypes.c_int64
    library.jdist_segments_posted.restype = ctypes.c_int64
    for target, symbol in ((START_TARGET, library.JdistDeferredStartCpu),
                           (FINISH_TARGET, library.JdistDeferredFinishCpu),
                           (SESSION_TARGET, library.JdistDeferredSessionCpu),
                           (HELD_TARGET, library.JdistDeferredHeldCpu)):
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    _registered = True
  return library


def available(route) -> bool:
  """Whether `route` runs deferred sums: the native route on CPU, across
  processes, with a library built with deferred.cc (not an older build)."""
  return (route.name == "native" and route.processes > 1 and native.running()
          and native.platform_of_devices() == "cpu"
          and hasattr(native._load(), "JdistDeferredStartCpu"))  # pylint: disable=protected-access


def applies(what: str = "a deferred sum") -> bool:
  """Whether a step being traced here can start deferred sums: a per-replica
  (`jdist.data_parallel`) step on a route that runs them (`available`)."""
  try:
    if context.in_global_step(what):
      return False
  except errors.CollectiveContextError:  # traced outside any step
    return False
  return available(routes.active())


def _device(axis: str) -> jax.Array:
  return lax.axis_index(axis).astype(np.int32)


def start(buffer: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
  """Starts the sum of a 1-D buffer over every replica; returns its token.

  Call it inside a per-replica step where `applies()`. The bytes it sends
  are recorded in the active `jdist.collectives.measure()` ledger.

  Returns:
    int32 [3]: [ordinal, seq, session], for `finish`.
  """
  route = routes.active()
  route.record(base.SUM, buffer.nbytes)
  _library()
  return jax.ffi.ffi_call(START_TARGET, jax.ShapeDtypeStruct(TOKEN_SHAPE, np.int32),
                          has_side_effect=True)(
      _device(axis), buffer, ordinal=np.int64(ORDINAL_BASE + base.next_ordinal()))


def finish(token: jax.Array, like: jax.ShapeDtypeStruct, axis: str = DATA_AXIS) -> jax.Array:
  """The sum `start` returned `token` for (`like`: its buffer's shape and dtype).

  Raises (when the step runs):
    an XLA error naming the exchange: the token was never started in this
    process, or asks for another size.
  """
  _library()
  return jax.ffi.ffi_call(FINISH_TARGET, jax.ShapeDtypeStruct(like.shape, like.dtype),
                          has_side_effect=True)(_device(axis), token.astype(np.int32))


def session() -> jax.Array:
  """This run's session (int32, >= 1), read at run time inside a step."""
  _library()
  return jax.ffi.ffi_call(SESSION_TARGET, jax.ShapeDtypeStruct((), np.int32))()


def held(token: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
  """Whether `finish(token)` would read a sum (int32 1/0, at run time): the
  token is this run's and its exchange is still kept on this device.

  The same on every process running the same steps: each keeps the same
  exchanges. Where 0, a caller holding the shares may sum them again.
  """
  _library()
  return jax.ffi.ffi_call(HELD_TARGET, jax.ShapeDtypeStruct((), np.int32),
                          has_side_effect=True)(_device(axis), token.astype(np.int32))


def outstanding() -> int:
  """Started exchanges (device parts) no finish has read yet; 0 without the library."""
  return int(_library().jdist_deferred_outstanding()) if native.running() else 0


def drain(timeout: float = 60.0) -> int:
  """Waits for every started exchange to complete, then forgets them all.

  For the end of training (after the last step): an exchange started and
  never finished is dropped. A finish of a dropped token is an error.

  Returns:
    How many exchanges (device parts) no finish had read.

  Raises:
    TimeoutError: some exchange did not complete within `timeout` seconds.
  """
  if not native.running():
    return 0
  dropped = int(_library().jdist_deferred_drain(float(timeout)))
  if dropped < 0:
    raise TimeoutError(f"jdist: deferred exchanges still in flight after {timeout} s")
  return dropped


def set_segment_bytes(nbytes: int) -> int:
  """Sets the wire bytes per segment of a started (background) sum; returns
  the previous value.

  Its segments cross one at a time, each posted once the previous one
  crossed: at most this many bytes of it are queued ahead of a step's own
  exchange. Starts from `$JDIST_NATIVE_BACKGROUND_SEGMENT_BYTES`, else 64 KiB.
  Every process must set the same value, between base.

  Args:
    nbytes: wire bytes per segment; 0 or less sends a started sum as any
      other sum (every segment at once, `native.set_segment_bytes`'s size).

  Raises:
    OSError: the native library is missing.
  """
  return int(_library().jdist_set_background_segment_bytes(int(nbytes)))


def segments_posted() -> int:
  """Segments of native sums (in-step and started) whose messages the engine
  handed to MPI since it started; minus `native.segments_completed()`, those
  on the wire. 0 when the engine never started."""
  return int(_library().jdist_segments_posted()) if native.running() else 0
