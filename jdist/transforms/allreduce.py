"""`allreduce`: the optax transformation that averages gradients over replicas."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdist import collectives
from jdist import fusion
from jdist.runtime import start_check
from jdist.compression import protocol


@protocol.register_wire_state
class AllReduceState(NamedTuple):
  """State of `allreduce`.

  Attributes:
    wire_bytes: bytes this process sent across processes in the last step
      (float32; see `jdist.collectives.routes.base` for how they are counted).
  """
  wire_bytes: jax.Array


def allreduce(mean: bool = True, *,
              bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> optax.GradientTransformation:
  """Sums or averages gradients over every replica (devices and processes).

  Put it after any compressor (`jdist.topk`, `jdist.threshold`, `jdist.cast`)
  and before the optimizer: it asks their payload to reduce itself. Runs
  inside a `jdist.data_parallel` step. (`jdist.powersgd` replaces it.)

  Args:
    mean: average (True) or sum (False) over replicas, like nnabla's
      `division` flag.
    bucket_bytes: tensor-fusion bucket size for the cross-process exchange.

  Returns:
    An `optax.GradientTransformation`.

  Raises:
    ValueError: a non-positive bucket size.
  """
  if not isinstance(mean, bool):
    raise ValueError(f"mean={mean!r} must be True (average) or False (sum).")
  if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
    raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive int.")

  def init_fn(params):
    start_check.note_initial_params(params, "jdist.allreduce")
    return AllReduceState(wire_bytes=jnp.zeros([], jnp.float32))

  def update_fn(updates, state, params=None):
    del state, params
    start_check.check_at_step()
    with collectives.measure("allreduce") as ledger:
      reduced = collectives.reduce_payload(updates, mean=mean, bucket_bytes=bucket_bytes)
    return reduced, AllReduceState(wire_bytes=jnp.asarray(ledger.bytes, jnp.float32))

  return optax.GradientTransformation(init_fn, update_fn)


def wire_bytes(opt_state: Any) -> jax.Array:
  """Bytes sent across processes in the last step by every jdist transformation
  whose state is in `opt_state` (one replica's state).

  Counts the states registered with
  `jdist.compression.protocol.register_wire_state` (`AllReduceState`,
  `PartialSyncState`, `PowerSGDState`), wherever they sit in the state.
  """
  found = [jnp.asarray(state.wire_bytes, jnp.float32)
           for state in protocol.wire_states(opt_state)]
  return sum(found, jnp.zeros([], jnp.float32))
