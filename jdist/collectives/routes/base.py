"""The base of every route: an exchange's three kinds, its bytes, its lowering.

`Route` (see `jdist.collectives.routes` for the four routes) offers
`sum_all`, `sum_all_16bit` and `gather_all` over every replica, records the
bytes they send across processes (`jdist.collectives.wire`) and runs them as
one primitive (`jdist.collectives.autodiff`), which makes them
differentiable and batchable; the helpers here are shared by the 16-bit
formats.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jdist.collectives import autodiff
from jdist.collectives import steps
from jdist.collectives import wire
from jdist.collectives.wire import DATA_AXIS

# The floats MPI cannot sum: they cross processes as uint16 bit patterns.
HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def pad_to(buffer: jax.Array, multiple: int) -> jax.Array:
  extra = -buffer.shape[0] % multiple
  return jnp.pad(buffer, (0, extra)) if extra else buffer


def bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x, jnp.uint16)


def from_bits(x: jax.Array, dtype) -> jax.Array:
  return lax.bitcast_convert_type(x, dtype)


def add_rows(rows: jax.Array) -> jax.Array:
  """Float32 sum of the rows of a small [P, m] array.

  Row by row rather than `.sum(axis=0)`: XLA:CPU runs the latter as a strided
  column reduction, measured 80x slower at 16 MB (benchmarks/sections/suite/proposals.py).
  """
  return functools.reduce(jnp.add, [rows[i].astype(jnp.float32) for i in range(rows.shape[0])])


def local_sum16(buffer: jax.Array, axis_size: int, axis: str = DATA_AXIS) -> jax.Array:
  """Reduce-scatter of 16-bit values over `axis`, accumulated in float32."""
  chunks = buffer.reshape(axis_size, -1)
  return add_rows(lax.all_to_all(chunks, axis, 0, 0))


class Route:
  """How buffers cross processes: the three primitives and their wire bytes.

  Subclasses implement `_sum`, `_sum16` and `_gather` for their transport,
  each given the exchange's ordinal (see `jdist.collectives.steps`). A route
  that crosses processes runs them as the lowering of one primitive
  (`jdist.collectives.autodiff.exchange`), which makes every exchange
  differentiable and batchable; `LocalRoute` uses XLA's collectives directly.

  Every exchange names the mapped axis its local devices are on (`axis`,
  `jdist.DATA_AXIS` in jdist's steps): the route reads nothing ambient.

  Attributes:
    name: the route's name, one of `ROUTES`.
    processes: processes in the job.
    devices: local devices per process.
  """

  name = ""
  chained = False  # whether a step's exchanges are ordered by `steps.chain_input`

  def __init__(self, topology):
    self.processes = topology.process_count
    self.devices = topology.local_device_count
    self.process_index = topology.process_index

  @property
  def replicas(self) -> int:
    """Replicas an exchange spans: every local device of every process."""
    return self.processes * self.devices

  def process_index_value(self) -> jax.Array:
    """This process's index inside a step, as a value XLA cannot fold (`steps.rank_value`)."""
    return steps.rank_value(self.process_index)

  def effects(self):
    """The JAX effects of this route's exchanges (none but mpi4jax's)."""
    return frozenset()

  def lower(self, kind: str, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    """The exchange of a 1-D buffer over `axis`, as `exchange_p` lowers it on this route."""
    return {autodiff.SUM: self._sum, autodiff.SUM16: self._sum16,
            autodiff.GATHER: self._gather}[kind](buffer, ordinal, axis)

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.processes} x {self.devices})"

  def sum_all(self, buffer: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
    """Sum of a 1-D buffer over every replica, in the buffer's dtype.

    `axis` is the mapped axis of this process's devices (all three primitives).
    """
    if buffer.dtype in HALF_DTYPES:
      return self.sum_all_16bit(buffer, axis)  # MPI has no 16-bit float sum
    self.record(autodiff.SUM, buffer.nbytes)
    return self._exchange(autodiff.SUM, buffer, axis)

  def sum_all_16bit(self, buffer: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
    """Sum over every replica of a float16/bfloat16 buffer.

    Every hop carries 16 bits per value; sums are accumulated in float32 and
    rounded once per hop. The caller pre-divides to keep sums in range.
    """
    self.record(autodiff.SUM16, buffer.nbytes)
    return self._exchange(autodiff.SUM16, buffer, axis)

  def gather_all(self, buffer: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
    """Every replica's 1-D buffer, stacked in global replica order: [R, n]."""
    self.record(autodiff.GATHER, buffer.nbytes)
    return self._exchange(autodiff.GATHER, buffer, axis)

  def record(self, kind: str, nbytes: int, calls: bool = True) -> None:
    """Adds an exchange of `nbytes` per replica to the ledger (`jdist.collectives.wire`).

    Also called for the exchanges a JVP, a transpose or `jax.vmap` adds
    (`calls=False` for a batch's further rows, which travel in the same call).
    """
    shares = 2 * (self.processes - 1) / self.processes
    if kind == autodiff.SUM:
      wire.record(shares * nbytes, int(calls))
    elif self.processes > 1:
      wire.record((shares if kind == autodiff.SUM16 else (self.processes - 1) * self.devices)
                  * nbytes, (2 if kind == autodiff.SUM16 else 1) * int(calls))

  def join(self, buffers: list[jax.Array]) -> list[jax.Array]:
    """The step's reduced buffers, read together (see `NativeRoute.join`)."""
    return list(buffers)

  def _exchange(self, kind: str, buffer: jax.Array, axis: str) -> jax.Array:
    return autodiff.exchange(self, kind, buffer, axis)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    raise NotImplementedError

  def _sum16(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    raise NotImplementedError

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    raise NotImplementedError
