"""Partial synchronization: local updates, one parameter chunk averaged per step.

SINGA's `backward_and_partial_update`: every replica updates all parameters
with its own (un-averaged) gradient; then one chunk of the *parameters* is
averaged over the replicas, the chunk rotating every step. Each step sends
1/num_chunks of a full exchange, and every parameter is averaged at least
once every `num_chunks` steps. The parameters are cut as one flat vector into
`num_chunks` equal runs of elements (bytes, for one dtype), in leaf order.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdist import collectives
from jdist import parallel
from jdist.collectives import fusion


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
    spec = fusion.flat_spec(updates)
    size = spec.size
    chunk = math.ceil(size / num_chunks)
    flat_params = fusion.ravel(params, jnp.float32)
    flat_updates = fusion.ravel(updates, jnp.float32)
    local = jnp.pad(flat_params + flat_updates, (0, chunk * num_chunks - size))
    start = (state.step % num_chunks) * chunk
    with collectives.measure() as ledger:
      averaged = collectives.pmean(lax.dynamic_slice(local, (start,), (chunk,)))
    synced = lax.dynamic_update_slice(local, averaged, (start,))[:size]
    position = jnp.arange(size)
    in_chunk = (position >= start) & (position < start + chunk)
    # Outside the chunk keep the local update bit for bit.
    new_updates = jnp.where(in_chunk, synced - flat_params, flat_updates)
    return (fusion.unravel(new_updates, spec),
            PartialSyncState(state.step + 1, jnp.asarray(ledger.bytes, jnp.float32)))

  return optax.GradientTransformation(init_fn, update_fn)


@functools.lru_cache(maxsize=None)
def _pmean_step():
  return parallel.data_parallel(collectives.pmean)


def sync_params(params: Any) -> Any:
  """Averages replicated parameters over every replica, all at once.

  Host side, between steps: before evaluation or a checkpoint under partial
  synchronization. Afterwards every replica holds identical values.

  Args:
    params: parameters replicated on the local devices (leading device axis).

  Returns:
    The averaged parameters, replicated the same way.
  """
  return _pmean_step()(params)
