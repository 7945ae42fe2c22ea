"""DiLoCo's outer sync in the background: a fragment's exchange across its delay.

With `jdist.diloco(..., delay=τ)` and a float32 (or sparse) payload, on
the native route in a `jdist.data_parallel` step (`applies`), a fragment's
sync step posts each replica's share of the averaged pseudo-gradient
(`start`) and ends without waiting for the wire; the apply step τ steps
later reads the sum (`average`). Meanwhile the state (`DiLoCoState`) holds
the exchange's token in `in_flight` and this replica's share in `pending`:
what a checkpoint needs to redo the exchange in another run. The math is the in-step path's:
shares scaled by 1/R in float32, summed by the same engine.

A sparse payload (`payload="sparse"`) cannot be summed: its bytes cross as
an all-gather (`start_gather`, `finish_gather`), which the engine's deferred
sum runs as a sum of int32 rows, each zero but for one replica's bytes
(exact: x + 0 = x). That sends 2 (P - 1) / P * R times a replica's bytes
per process where an all-gather sends (P - 1) * D times them: twice as many
at 2 processes of 1 device, the same at 2 x 2, and what the ledger counts.
`pending` then holds this replica's share of the decoded mean, enough to
redo the exchange as a sum.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jdist import collectives
from jdist import fusion
from jdist.collectives import deferred
from jdist.runtime import job as job_lib

TOKEN_SHAPE = deferred.TOKEN_SHAPE  # DiLoCoState.in_flight's rows


def applies(delay: int, payload_has_background: bool) -> bool:
  """Whether the step being traced runs its outer syncs in the background.

  Args:
    delay: DiLoCo's τ (0: no background).
    payload_has_background: whether the payload has a background exchange
      here (float32: `start`; sparse: `start_gather`).
  """
  return bool(delay) and payload_has_background and deferred.applies("jdist.diloco")


def start(delta: list[jax.Array], pending: list[jax.Array],
          leaves: list[int]) -> tuple[list[jax.Array], jax.Array, float]:
  """Posts this replica's share of the mean of `delta`, one fragment's leaves.

  Returns:
    (`pending` with the share in the fragment's `leaves`: enough to redo the
    exchange; the token for `average`; the bytes it sends across processes).
  """
  share = fusion.ravel(delta, jnp.float32) * jnp.float32(
      1.0 / job_lib.current().replica_count)  # as collectives.reduce_payload's mean
  with collectives.measure("DiLoCo") as ledger:
    token = deferred.start(share)
  pending = list(pending)
  for i, value in zip(leaves, fusion.unravel(share, fusion.flat_spec(delta))):
    pending[i] = value
  return pending, token, ledger.bytes


def start_gather(wire: jax.Array) -> tuple[jax.Array, float]:
  """Posts this replica's uint8 `wire` bytes as its row of an all-gather.

  Returns:
    (the token for `finish_gather`; the bytes it sends across processes).
  """
  replicas = job_lib.current().replica_count
  words = lax.bitcast_convert_type(jnp.pad(wire, (0, -wire.shape[0] % 4)).reshape(-1, 4),
                                   jnp.int32)
  rows = jnp.zeros((replicas, words.shape[0]), jnp.int32).at[collectives.replica_index()].set(
      words)
  with collectives.measure("DiLoCo") as ledger:
    token = deferred.start(rows.reshape(-1))
  return token, ledger.bytes


def finish_gather(token: jax.Array, size: int) -> jax.Array:
  """Every replica's `size` bytes started by `start_gather`: uint8 [R, size]."""
  replicas = job_lib.current().replica_count
  words = -(-size // 4)
  summed = deferred.finish(token, jax.ShapeDtypeStruct((replicas * words,), jnp.int32))
  rows = lax.bitcast_convert_type(summed.reshape(replicas, words), jnp.uint8)
  return rows.reshape(replicas, 4 * words)[:, :size]


def average(pending: list[jax.Array], token: jax.Array,
            finish: Callable[[], jax.Array] | None = None) -> list[jax.Array]:
  """A fragment's averaged pseudo-gradient, from its `pending` leaves and token.

  By the token: session 0, the average is in `pending` already (exchanged
  inside its step: a state from another route); held (`deferred.held`),
  the started exchange's sum; else (a checkpoint of another run, or one
  restored in this run after the sum was dropped) the shares in `pending`
  summed again, here. Every process decides alike.

  Args:
    pending: the fragment's `pending` leaves.
    token: its exchange's token.
    finish: () -> the flat float32 average of a held exchange; default: the
      started sum of the shares (`start`'s).
  """
  flat = fusion.ravel(pending, jnp.float32)
  how = jnp.where(token[2] == 0, 0, jnp.where(deferred.held(token) == 1, 1, 2))
  summed = lax.switch(how, [
      lambda: flat,
      finish or (lambda: deferred.finish(token, jax.ShapeDtypeStruct(flat.shape, flat.dtype))),
      lambda: collectives.psum(flat)])
  return fusion.unravel(summed, fusion.flat_spec(pending))
