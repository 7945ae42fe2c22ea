"""Partial synchronization: local updates, one parameter chunk averaged per step.

SINGA's `backward_and_partial_update`: every replica updates all parameters
with its own (un-averaged) gradient; then one chunk of the *parameters* is
averaged over the replicas, the chunk rotating every step. Each step sends
1/num_chunks of a full exchange, and every parameter is averaged at least
once every `num_chunks` steps. The parameters are cut as one flat vector into
`num_chunks` equal runs of elements (bytes, for one dtype), in leaf order.

The current chunk's pieces are read and written back by a `lax.switch` on
the step, each branch with its chunk's leaf pieces known statically, so a
step touches only that chunk's share of the model, not a flattened copy of
all of it; the exchange itself (one buffer of the largest chunk's size) sits
between the two switches.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdist import collectives
from jdist.compression import protocol


def chunk_plan(sizes: list[int], num_chunks: int) -> list[list[tuple[int, int, int]]]:
  """Cuts leaves of `sizes` elements, in order, into `num_chunks` equal runs.

  Returns:
    Per chunk, its (leaf, start, stop) pieces: elements start:stop of the
    flattened leaf. Chunks hold ceil(total / num_chunks) elements (the last
    one the rest); with fewer elements than chunks, empty chunks are dropped.
  """
  total = sum(sizes)
  width = max(1, math.ceil(total / num_chunks))
  plan = []
  for begin in range(0, total, width):
    end, pieces, offset = min(begin + width, total), [], 0
    for leaf, size in enumerate(sizes):
      lo, hi = max(begin, offset), min(end, offset + size)
      if lo < hi:
        pieces.append((leaf, lo - offset, hi - offset))
      offset += size
    plan.append(pieces)
  return plan


@protocol.register_wire_state
class PartialSyncState(NamedTuple):
  """State of `partial_sync`.

  Attributes:
    step: steps taken; chunk `step % num_chunks` is averaged next.
    wire_bytes: bytes this process sent across processes in the last step.
  """
  step: jax.Array
  wire_bytes: jax.Array


def partial_sync(num_chunks: int) -> optax.GradientTransformation:
  """Averages one rotating chunk of parameters per step (after the optimizer).

  Place it last: `optax.chain(optax.sgd(...), jdist.partial_sync(4))`. The
  updates it receives are local; the ones it returns move the current chunk
  of parameters to its average over every replica and leave the rest local.

  Args:
    num_chunks: number of chunks; 1 averages every parameter every step.

  Raises:
    ValueError: num_chunks is not a positive int.
  """
  if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
    raise ValueError(f"num_chunks={num_chunks!r} must be an int >= 1.")

  def init_fn(params):
    del params
    return PartialSyncState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("jdist.partial_sync averages parameters, so tx.update needs "
                       "them: call tx.update(grads, opt_state, params).")
    update_leaves, treedef = jax.tree.flatten(updates)
    param_leaves = treedef.flatten_up_to(params)
    plan = chunk_plan([math.prod(leaf.shape) for leaf in update_leaves], num_chunks)
    if not plan:  # no parameters
      return updates, PartialSyncState(state.step + 1, jnp.zeros([], jnp.float32))
    width = max(sum(hi - lo for _, lo, hi in pieces) for pieces in plan)

    def take(pieces, update_leaves, param_leaves):
      """The chunk's locally updated values, padded to `width`."""
      local = [param_leaves[leaf].reshape(-1)[lo:hi].astype(jnp.float32)
               + update_leaves[leaf].reshape(-1)[lo:hi].astype(jnp.float32)
               for leaf, lo, hi in pieces]
      flat = jnp.concatenate(local) if len(local) > 1 else local[0]
      return jnp.pad(flat, (0, width - flat.shape[0]))

    def put(pieces, averaged, update_leaves, param_leaves):
      """The updates that move the chunk's parameters to `averaged`."""
      out = list(update_leaves)
      offset = 0
      for leaf, lo, hi in pieces:
        flat_param = param_leaves[leaf].reshape(-1)[lo:hi].astype(jnp.float32)
        moved = averaged[offset:offset + hi - lo] - flat_param
        offset += hi - lo
        # Outside the chunk the local update stays bit for bit.
        flat = lax.dynamic_update_slice(out[leaf].reshape(-1), moved.astype(out[leaf].dtype),
                                        (lo,))
        out[leaf] = flat.reshape(update_leaves[leaf].shape)
      return out

    # The exchange stays outside lax.switch (collectives in control flow
    # would escape the exchange ordering of jdist.collectives).
    chunk = state.step % len(plan)
    local = lax.switch(chunk, [functools.partial(take, p) for p in plan], update_leaves,
                       param_leaves)
    with collectives.measure("partial sync") as ledger:
      averaged = collectives.pmean(local)
    new_leaves = lax.switch(chunk, [functools.partial(put, p) for p in plan], averaged,
                            update_leaves, param_leaves)
    return (jax.tree.unflatten(treedef, new_leaves),
            PartialSyncState(state.step + 1, jnp.asarray(ledger.bytes, jnp.float32)))

  return optax.GradientTransformation(init_fn, update_fn)


SCHEME = protocol.Scheme(
    "partial", "after", protocol.enabled, lambda chunks, o: partial_sync(chunks),
    does="averages parameters with a full-precision exchange of one chunk per step",
    flag={"type": int, "metavar": "CHUNKS", "help": "SINGA's partial update: local steps, "
          "one of CHUNKS parameter chunks averaged per step (not with --half/--sparsify)"})
