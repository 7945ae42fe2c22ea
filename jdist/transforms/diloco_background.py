"""DiLoCo's outer sync in the background: a fragment's exchange across its delay.

With `jdist.diloco(..., delay=τ)` and a float32 payload, on the native route
in a `jdist.data_parallel` step (`applies`), a fragment's sync step posts
each replica's share of the averaged pseudo-gradient (`start`) and ends
without waiting for the wire; the apply step τ steps later reads the sum
(`average`). Meanwhile the state (`DiLoCoState`) holds the exchange's token
in `in_flight` and this replica's share in `pending`: what a checkpoint
needs to redo the exchange in another run. The math is the in-step path's:
shares scaled by 1/R in float32, summed by the same engine.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdist import collectives
from jdist import fusion
from jdist.collectives import deferred
from jdist.runtime import topology as topology_lib

TOKEN_SHAPE = deferred.TOKEN_SHAPE  # DiLoCoState.in_flight's rows


def applies(delay: int, codec: Any) -> bool:
  """Whether the step being traced runs its outer syncs in the background."""
  return bool(delay) and codec is None and deferred.applies("jdist.diloco")


def start(delta: list[jax.Array], pending: list[jax.Array],
          leaves: list[int]) -> tuple[list[jax.Array], jax.Array, float]:
  """Posts this replica's share of the mean of `delta`, one fragment's leaves.

  Returns:
    (`pending` with the share in the fragment's `leaves`: enough to redo the
    exchange; the token for `average`; the bytes it sends across processes).
  """
  share = fusion.ravel(delta, jnp.float32) * jnp.float32(
      1.0 / topology_lib.current().replica_count)  # as collectives.reduce_payload's mean
  with collectives.measure("DiLoCo") as ledger:
    token = deferred.start(share)
  pending = list(pending)
  for i, value in zip(leaves, fusion.unravel(share, fusion.flat_spec(delta))):
    pending[i] = value
  return pending, token, ledger.bytes


def average(pending: list[jax.Array], token: jax.Array) -> list[jax.Array]:
  """A fragment's averaged pseudo-gradient, from its `pending` leaves and token.

  By the token: session 0, the average is in `pending` already (exchanged
  inside its step: a state from another route); held (`deferred.held`),
  the started exchange's sum; else (a checkpoint of another run, or one
  restored in this run after the sum was dropped) the shares in `pending`
  summed again, here. Every process decides alike.
  """
  flat = fusion.ravel(pending, jnp.float32)
  how = jnp.where(token[2] == 0, 0, jnp.where(deferred.held(token) == 1, 1, 2))
  summed = lax.switch(how, [
      lambda: flat,
      lambda: deferred.finish(token, jax.ShapeDtypeStruct(flat.shape, flat.dtype)),
      lambda: collectives.psum(flat)])
  return fusion.unravel(summed, fusion.flat_spec(pending))
