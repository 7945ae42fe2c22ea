"""One exchange over every replica: the route's base, its primitive, its place and bytes.

`Route` (see `jdist.collectives.routes` for the four routes) offers
`sum_all`, `sum_all_16bit` and `gather_all` over every replica. Each
exchange of a route that crosses processes is, from where it is traced to
where it runs:

**Its place in the step** (`step_scope`, `next_ordinal`). `jdist.data_parallel`
traces the user's step inside `step_scope()`. Every cross-process exchange
traced in it takes the next *ordinal*: its position in the step, counted
from 0 each time the step is traced, so the same on every process (every
process traces the same program). The native route names its exchanges by
ordinal; nothing else orders them.

The callback route (the fallback) still needs every device of every process
to run a step's exchanges in one order, since each blocks an XLA thread:
`chain_input`/`chain_output` make each exchange's input depend on the
previous exchange's output within the same trace, keyed by JAX's public
`jax.extend.core.get_opaque_trace_state()`. Exchanges inside `lax.cond`
branches are chained within their branch only: that route does not order a
branch against the exchanges around its `cond`.

The native route has no chain: XLA runs a step's exchanges in the order its
scheduler gives them, which is the same on every process only when every
process compiles the same program. A rank-dependent Python integer in the
trace (a replica's index) breaks that: XLA folds `0 * k + i` to `i` on rank 0
only, the programs differ in shape, and their schedules may order two
independent exchanges differently, each rank then waiting in the exchange
the other has not reached (measured: the autodiff tests' jit step in 2 x 2).
`rank_value` keeps such integers out of XLA's algebra.

**One JAX primitive** (`exchange`, `exchange_p`). A route's cross-process
exchange is an XLA FFI custom call, a host callback or an mpi4jax call; none
of them has a JVP, a transpose or (for the first two) a batching rule. The
route binds `exchange_p` instead, a primitive whose parameters say
everything about the call (the route object, the kind, the exchange's
ordinal, the mapped axis of the local devices), with:

  * abstract evaluation: a sum keeps the buffer's shape and dtype; a gather
    adds a leading axis of one row per replica;
  * a JVP: the same exchange of the tangent (all three are linear);
  * a transpose, as `lax.psum`'s in a `pmap` or in `jdist.data_parallel`'s
    `shard_map` (`check_vma=False`): the transpose of a sum over replicas is
    a sum over replicas; of a gather, the sum over replicas of the
    cotangent's rows, each replica taking its own row (as
    `lax.psum_scatter`). So `jax.grad` of a loss through `jdist.pmean`
    gives, on every replica, what XLA's own collectives give in one process
    with as many devices: averaged over replicas (as `jdist.allreduce`
    does), the gradient of one device on the whole batch;
  * a batching rule (`jax.vmap`): a sum is elementwise, so the batched
    buffer crosses processes flattened, as one exchange;
  * a lowering: `mlir.lower_fun` of the route's own implementation
    (`Route.lower`), so each route keeps its transport.

Everything the routes decided at trace time is decided at `bind`: the
ordinal, the callback route's chain and the bytes recorded in the ledger.
Rules that exchange again (a JVP's tangent, a transpose) bind a new exchange
the same way, with the route and the axis taken from the parameters:
nothing ambient decides them (a global step's backward pass is traced
outside the `shard_map` of its forward reduction).

**Its bytes** (`measure`, `add_to_ledger`). Every route records the bytes
this process sends across processes in the active `measure()` ledger, by
the bandwidth-optimal algorithm's count: an all-reduce of b bytes sends
2(P-1)/P*b per process, an all-gather of b bytes per process sends (P-1)*b.
The helpers at the end are shared by the 16-bit formats.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.extend.core  # not loaded by `import jax`; a script importing nothing else would fail
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir
import numpy as np

from jdist.runtime import flight_recorder

DATA_AXIS = "data"  # the mapped axis of the local devices in jdist's steps (`jdist.DATA_AXIS`)


# The ledger of bytes that cross processes.



@dataclasses.dataclass
class WireLedger:
  """Bytes and MPI calls this process sends across processes per step."""
  bytes: int = 0
  calls: int = 0


_ledger: contextvars.ContextVar[WireLedger | None] = contextvars.ContextVar(
    "jdist_wire_ledger", default=None)


@contextlib.contextmanager
def measure(scheme: str | None = None):
  """Collects the cross-process traffic of the collectives traced inside.

  Args:
    scheme: the communication scheme tracing them ("DiLoCo"), which names
      their exchanges in the flight recorder and the timeline.
  """
  ledger = WireLedger()
  token = _ledger.set(ledger)
  try:
    with flight_recorder.scheme(scheme):
      yield ledger
  finally:
    _ledger.reset(token)


def add_to_ledger(nbytes: float, calls: int) -> None:
  """Adds one exchange's bytes and MPI calls to the active ledger, if any."""
  ledger = _ledger.get()
  if ledger is not None:
    ledger.bytes += int(round(nbytes))
    ledger.calls += calls


# Which exchange of a step is which: ordinals and the callback route's chain.

# Outside any step scope (a user's own pmap over DATA_AXIS) ordinals come from
# one process-wide counter, far above a step's: they match across processes
# only if every process traces the same functions in the same order. The
# native engine tags an exchange's messages by ordinal and segment within
# MPI's 31-bit tags, which leaves room for 2**25 ordinals.
_UNSCOPED_FIRST = 1 << 20
_unscoped = itertools.count(_UNSCOPED_FIRST)
_CHAIN_LIMIT = 64  # unscoped traces remembered by the callback route's chain
_HOST_TRACE = jax.extend.core.get_opaque_trace_state()  # no trace: eager, on the host


@dataclasses.dataclass
class StepScope:
  """Per-trace state of one step: the next ordinal and the chain's tails."""
  name: str
  next_ordinal: int = 0
  chain: list[tuple[Any, jax.Array]] = dataclasses.field(default_factory=list)


_scope: contextvars.ContextVar[StepScope | None] = contextvars.ContextVar(
    "jdist_step_scope", default=None)
_unscoped_chain: list[tuple[Any, jax.Array]] = []
_collected: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "jdist_collected_ordinals", default=None)


@contextlib.contextmanager
def collect_unscoped():
  """Yields a list that gets every ordinal traced outside a step scope inside."""
  found: list[int] = []
  token = _collected.set(found)
  try:
    yield found
  finally:
    _collected.reset(token)


@contextlib.contextmanager
def step_scope(name: str):
  """Numbers the exchanges traced inside from 0 (wrap a step's body in it)."""
  token = _scope.set(StepScope(name))
  try:
    yield
  finally:
    _scope.reset(token)


def next_ordinal() -> int:
  """The ordinal of the exchange being traced (see module doc)."""
  scope = _scope.get()
  if scope is None:
    ordinal = next(_unscoped)
    collected = _collected.get()
    if collected is not None:
      collected.append(ordinal)
    return ordinal
  ordinal = scope.next_ordinal
  scope.next_ordinal += 1
  return ordinal


def scope_name() -> str | None:
  """The name of the step being traced (`step_scope`), or None outside one."""
  scope = _scope.get()
  return scope.name if scope is not None else None


def _chain() -> list[tuple[Any, jax.Array]]:
  scope = _scope.get()
  return scope.chain if scope is not None else _unscoped_chain


def tracing() -> bool:
  """Whether a JAX trace (a step being compiled) is active, not eager host code."""
  return not jax.extend.core.get_opaque_trace_state() == _HOST_TRACE


def rank_value(value: int) -> jax.Array:
  """A rank-dependent integer as an int32 XLA cannot fold into the program.

  Behind an optimization barrier every process compiles the same program,
  differing only in this literal (see module doc), so XLA schedules the
  exchanges around it alike everywhere.
  """
  return jax.lax.optimization_barrier(jnp.asarray(value, jnp.int32))


def _runtime_zero(token: jax.Array) -> jax.Array:
  """0.0, computed from `token` at run time (XLA cannot fold it away), NaN-safe."""
  value = token.reshape(-1)[0].astype(jnp.float32)
  return jnp.where(jnp.isnan(value), 0.0, jnp.minimum(jnp.abs(value), 0.0))


def chain_input(buffer: jax.Array) -> jax.Array:
  """`buffer`, computable only once the previous exchange of this trace is done.

  The dependency is real arithmetic (entry 0 plus a run-time zero): with an
  `optimization_barrier` instead, which aliases its operands and runs no
  operation of its own, the 2x2 deadlock of the callback route still
  happened.
  """
  if buffer.size == 0:
    return buffer
  trace = jax.extend.core.get_opaque_trace_state()
  for state, last in reversed(_chain()):
    if state == trace:
      # Not differentiated: the order is a schedule, not a dependency of values.
      return buffer.at[0].add(_runtime_zero(jax.lax.stop_gradient(last)).astype(buffer.dtype))
  return buffer


def chain_tail() -> jax.Array | None:
  """The last exchange of the current trace, as its first entry; None if none.

  Hands the chain across a nested trace (a global step's `shard_map` per
  reduction): pass it in, `chain_output` it there first, pass the inner
  tail back out and `chain_output` that.
  """
  trace = jax.extend.core.get_opaque_trace_state()
  for state, last in reversed(_chain()):
    if state == trace:
      return last.reshape(-1)[:1]
  return None


def chain_output(out: jax.Array) -> jax.Array:
  """Records `out` as the last exchange of the current trace; returns it."""
  if out.size:
    trace = jax.extend.core.get_opaque_trace_state()
    chain = _chain()
    chain[:] = [(state, last) for state, last in chain if not state == trace]
    chain.append((trace, out))
    if chain is _unscoped_chain and len(chain) > _CHAIN_LIMIT:
      del chain[0]
  return out


# Every cross-process exchange as one primitive.

SUM, SUM16, GATHER = "sum", "sum16", "gather"
KINDS = (SUM, SUM16, GATHER)

exchange_p = jax.extend.core.Primitive("jdist_cross_process")


def exchange(route, kind: str, buffer: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
  """One exchange of `buffer` over every replica on `route`, as `exchange_p`.

  Args:
    route: a `jdist.collectives.routes.Route` that crosses processes; it
      provides `lower(kind, buffer, ordinal, axis)`, `replicas`,
      `process_index`, `chained` and `effects()`.
    kind: SUM, SUM16 or GATHER.
    buffer: this replica's values (any shape; the routes send it flat).
    axis: the mapped axis of this process's devices (bound where it is traced).

  Returns:
    The sum (the buffer's shape) or the gather (a leading axis of one row per
    replica, in global replica order).
  """
  if kind not in KINDS:
    raise ValueError(f"unknown exchange kind {kind!r}; one of {KINDS}")
  if route.chained:  # the callback route runs a step's exchanges in trace order
    buffer = chain_input(buffer)
  ordinal = next_ordinal()
  flight_recorder.note_traced(route.name, kind, ordinal, buffer.nbytes, scope_name())
  out = exchange_p.bind(buffer, route=route, kind=kind, ordinal=ordinal, axis=axis)
  return chain_output(out) if route.chained else out


def _again(route, kind: str, buffer: jax.Array, axis: str) -> jax.Array:
  """A further exchange that a rule adds (a tangent, a cotangent), on the ledger too."""
  route.record(kind, buffer.nbytes)
  return exchange(route, kind, buffer, axis)


def _abstract_eval(aval, *, route, kind, ordinal, axis):
  del ordinal, axis
  shape = (route.replicas,) + aval.shape if kind == GATHER else aval.shape
  return aval.update(shape=shape), route.effects()


def _lowered(buffer, *, route, kind, ordinal, axis):
  out = route.lower(kind, buffer.reshape(-1), ordinal, axis)
  return out.reshape((route.replicas,) + buffer.shape if kind == GATHER else buffer.shape)


def _jvp(primals, tangents, *, route, kind, ordinal, axis):
  (x,), (t,) = primals, tangents
  y = exchange_p.bind(x, route=route, kind=kind, ordinal=ordinal, axis=axis)
  if type(t) is ad.Zero:
    return y, ad.Zero.from_primal_value(y)
  # Linear: the tangent crosses processes alike. Not on the ledger: under
  # jax.grad this exchange is transposed, never run; the transpose counts.
  return y, exchange(route, kind, t, axis)


def _transpose(ct, x, *, route, kind, ordinal, axis):
  del ordinal
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  if kind != GATHER:
    return (_again(route, kind, ct, axis),)
  # Each replica's row i went to every replica; its cotangent is the sum
  # over replicas of row i: a full sum, of which this replica keeps its row.
  summed = _again(route, SUM, ct, axis)
  mine = route.process_index_value() * route.devices + lax.axis_index(axis)
  return (lax.dynamic_index_in_dim(summed, mine, 0, keepdims=False),)


def _batch(args, dims, *, route, kind, ordinal, axis):
  (x,), (dim,) = args, dims
  x = jnp.moveaxis(x, dim, 0)
  # The same one exchange (the same ordinal): it replaces the unbatched call,
  # whose bytes were counted for one row of the batch.
  route.record(kind, (x.shape[0] - 1) * (x.nbytes // max(x.shape[0], 1)), calls=False)
  out = exchange_p.bind(x.reshape(-1), route=route, kind=kind, ordinal=ordinal, axis=axis)
  if kind == GATHER:
    return out.reshape((route.replicas,) + x.shape), 1
  return out.reshape(x.shape), 0


exchange_p.def_impl(_lowered)  # eager (a shard_map under jax.disable_jit): the route itself
exchange_p.def_effectful_abstract_eval(_abstract_eval)
ad.primitive_jvps[exchange_p] = _jvp
ad.primitive_transposes[exchange_p] = _transpose
batching.primitive_batchers[exchange_p] = _batch
mlir.register_lowering(exchange_p, mlir.lower_fun(_lowered, multiple_results=False))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def join(route, buffers: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """`route.join(buffers)`, the identity: differentiable, its tangents unjoined."""
  return tuple(route.join(list(buffers)))


@join.defjvp
def _join_jvp(route, primals, tangents):
  (buffers,), (dots,) = primals, tangents
  return join(route, buffers), dots


# The base of every route.

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
  each given the exchange's ordinal (`next_ordinal`). A route
  that crosses processes runs them as the lowering of one primitive
  (`jdist.collectives.exchange`), which makes every exchange
  differentiable and batchable; `LocalRoute` uses XLA's collectives directly.

  Every exchange names the mapped axis its local devices are on (`axis`,
  `jdist.DATA_AXIS` in jdist's steps): the route reads nothing ambient.

  Attributes:
    name: the route's name, one of `ROUTES`.
    processes: processes in the job.
    devices: local devices per process.
  """

  name = ""
  chained = False  # whether a step's exchanges are ordered by `chain_input`

  def __init__(self, topology):
    self.processes = topology.process_count
    self.devices = topology.local_device_count
    self.process_index = topology.process_index

  @property
  def replicas(self) -> int:
    """Replicas an exchange spans: every local device of every process."""
    return self.processes * self.devices

  def process_index_value(self) -> jax.Array:
    """This process's index inside a step, as a value XLA cannot fold (`rank_value`)."""
    return rank_value(self.process_index)

  def effects(self):
    """The JAX effects of this route's exchanges (none but mpi4jax's)."""
    return frozenset()

  def lower(self, kind: str, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    """The exchange of a 1-D buffer over `axis`, as `exchange_p` lowers it on this route."""
    return {SUM: self._sum, SUM16: self._sum16,
            GATHER: self._gather}[kind](buffer, ordinal, axis)

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.processes} x {self.devices})"

  def sum_all(self, buffer: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
    """Sum of a 1-D buffer over every replica, in the buffer's dtype.

    `axis` is the mapped axis of this process's devices (all three primitives).
    """
    if buffer.dtype in HALF_DTYPES:
      return self.sum_all_16bit(buffer, axis)  # MPI has no 16-bit float sum
    self.record(SUM, buffer.nbytes)
    return self._exchange(SUM, buffer, axis)

  def sum_all_16bit(self, buffer: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
    """Sum over every replica of a float16/bfloat16 buffer.

    Every hop carries 16 bits per value; sums are accumulated in float32 and
    rounded once per hop. The caller pre-divides to keep sums in range.
    """
    self.record(SUM16, buffer.nbytes)
    return self._exchange(SUM16, buffer, axis)

  def gather_all(self, buffer: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
    """Every replica's 1-D buffer, stacked in global replica order: [R, n]."""
    self.record(GATHER, buffer.nbytes)
    return self._exchange(GATHER, buffer, axis)

  def record(self, kind: str, nbytes: int, calls: bool = True) -> None:
    """Adds an exchange of `nbytes` per replica to the ledger (`add_to_ledger`).

    Also called for the exchanges a JVP, a transpose or `jax.vmap` adds
    (`calls=False` for a batch's further rows, which travel in the same call).
    """
    shares = 2 * (self.processes - 1) / self.processes
    if kind == SUM:
      add_to_ledger(shares * nbytes, int(calls))
    elif self.processes > 1:
      add_to_ledger((shares if kind == SUM16 else (self.processes - 1) * self.devices)
                  * nbytes, (2 if kind == SUM16 else 1) * int(calls))

  def join(self, buffers: list[jax.Array]) -> list[jax.Array]:
    """The step's reduced buffers, read together (see `NativeRoute.join`)."""
    return list(buffers)

  def _exchange(self, kind: str, buffer: jax.Array, axis: str) -> jax.Array:
    return exchange(self, kind, buffer, axis)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    raise NotImplementedError

  def _sum16(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    raise NotImplementedError

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    raise NotImplementedError
