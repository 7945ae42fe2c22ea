"""Which exchange of a step is which: ordinals and the callback route's chain.

`jdist.data_parallel` traces the user's step inside `step_scope()`. Every
cross-process exchange traced in it takes the next *ordinal*: its position
in the step, counted from 0 each time the step is traced, so the same on
every process (every process traces the same program). The native route
names its exchanges by ordinal; nothing else orders them.

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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from typing import Any

import jax
import jax.extend.core  # not loaded by `import jax`; a script importing nothing else would fail
import jax.numpy as jnp

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
