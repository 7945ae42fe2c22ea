"""Cross-process exchanges as one JAX primitive: differentiable and batchable.

A route's cross-process exchange (a sum, a 16-bit sum or an all-gather over
every replica) is an XLA FFI custom call, a host callback or an mpi4jax
call; none of them has a JVP, a transpose or (for the first two) a batching
rule. `exchange(route, kind, buffer, axis)` binds `exchange_p` instead, a
primitive whose parameters say everything about the call (the route object,
the kind, the exchange's ordinal, the mapped axis of the local devices), with:

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
ordinal the native engine names the exchange by (`steps.next_ordinal`), the
callback route's exchange chain (`steps.chain_input`/`chain_output`) and the
bytes recorded in the ledger. Rules that exchange again (a JVP's tangent, a
transpose) bind a new exchange the same way, with the route and the axis
taken from the parameters: nothing ambient decides them (a global step's
backward pass is traced outside the `shard_map` of its forward reduction).
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from jdist.collectives import steps
from jdist.collectives.wire import DATA_AXIS
from jdist.runtime import flight_recorder

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
    buffer = steps.chain_input(buffer)
  ordinal = steps.next_ordinal()
  flight_recorder.note_traced(route.name, kind, ordinal, buffer.nbytes, steps.scope_name())
  out = exchange_p.bind(buffer, route=route, kind=kind, ordinal=ordinal, axis=axis)
  return steps.chain_output(out) if route.chained else out


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
