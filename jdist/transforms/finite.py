"""`skip_nonfinite`: every replica skips a step whose gradients hold NaN or Inf.

A NaN or Inf in one replica's gradients would reach every replica through
the all-reduce and poison the parameters. `optax.apply_if_finite` skips such
steps, but it decides per replica: if replicas decided differently (a check
placed before the all-reduce, on local gradients) their parameters would
silently diverge. `skip_nonfinite` decides once for the whole job: each
replica's "my gradients, or the updates the chain made of them, are not
finite" flag is summed over every replica with `jdist.psum`, so all replicas
skip the same steps together. The updates are checked after the inner chain
(after the all-reduce and any 16-bit or sparse decode), so an overflow on
the wire (float16 tops out at 65504) is skipped like a NaN in a gradient.

The inner transformation (typically the whole `jdist.dist_opt` chain) runs
on every step, skipped or not, so every replica always makes the same
collective calls in the same order; a skipped step only discards its
result: the updates are zeros and the inner state stays as it was.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jdist import collectives
from jdist.runtime import flight_recorder


class SkipNonFiniteState(NamedTuple):
  """State of `skip_nonfinite`.

  Attributes:
    skipped: steps skipped so far (int32).
    consecutive: steps skipped in a row up to the last one (int32; 0 after
      a step that was applied).
    inner_state: the inner transformation's state, unchanged by skipped steps.
  """
  skipped: jax.Array
  consecutive: jax.Array
  inner_state: Any


def _count_nonfinite(tree: Any) -> jax.Array:
  """1 if any inexact leaf of `tree` holds a NaN or an Inf, else 0 (int32)."""
  flags = [jnp.any(~jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
           if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact)]
  if not flags:
    return jnp.zeros([], jnp.int32)
  return jnp.any(jnp.stack(flags)).astype(jnp.int32)


def skip_nonfinite(inner: optax.GradientTransformation, *,
                   max_consecutive: int | None = None) -> optax.GradientTransformation:
  """Wraps `inner` so that all replicas skip any step with non-finite gradients.

  Use it around the whole data-parallel chain, inside a `jdist.data_parallel`
  step:

    tx = jdist.skip_nonfinite(jdist.dist_opt(optax.adam(1e-3)), max_consecutive=10)

  If the incoming gradients of ANY replica, or the updates the inner chain
  computed from them (after the exchange), contain a NaN or an Inf, EVERY
  replica returns zero updates and keeps the inner state unchanged; the
  decision is reduced over replicas with `jdist.psum`, so replicas never
  diverge.

  `max_consecutive` bounds how long a run can hide behind skipping, with the
  semantics of `optax.apply_if_finite`: after `max_consecutive` skipped steps
  in a row, the next non-finite step is applied (NaN/Inf reach the
  parameters, so the loss shows it) instead of skipped forever; applying it
  resets the count. Stop training yourself earlier by watching
  `state.consecutive` (e.g. raise when it reaches a limit). Applying keeps
  the transformation a pure function: the decision is the same on every
  replica, so they stay identical either way.

  Args:
    inner: the transformation to protect (e.g. `jdist.dist_opt(...)`).
    max_consecutive: None (always skip) or an int >= 1: skip at most this
      many non-finite steps in a row.

  Returns:
    An `optax.GradientTransformation` with `SkipNonFiniteState`.

  Raises:
    ValueError: `inner` is not a GradientTransformation or
      `max_consecutive` is not None or a positive int.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise ValueError(f"inner={inner!r} is not an optax.GradientTransformation; wrap an "
                     f"optimizer chain, e.g. jdist.skip_nonfinite(jdist.dist_opt(optax.sgd(0.1))).")
  if max_consecutive is not None and (isinstance(max_consecutive, bool)
                                      or not isinstance(max_consecutive, int)
                                      or max_consecutive < 1):
    raise ValueError(f"max_consecutive={max_consecutive!r} must be None (always skip) or an "
                     f"int >= 1 (skip at most that many non-finite steps in a row).")

  def init_fn(params):
    zero = jnp.zeros([], jnp.int32)
    return SkipNonFiniteState(skipped=zero, consecutive=zero, inner_state=inner.init(params))

  def update_fn(updates, state, params=None):
    # The inner chain runs every step, so every replica makes the same collective calls.
    new_updates, new_inner = inner.update(updates, state.inner_state, params)
    # Judged on what would be applied too: a 16-bit payload can overflow on the
    # wire (or a decode produce NaN) although every replica's gradients were
    # finite. Summed over every replica: the same decision everywhere.
    local = jnp.maximum(_count_nonfinite(updates), _count_nonfinite(new_updates))
    with flight_recorder.scheme("finite check"):
      nonfinite = collectives.psum(local) > 0
    skip = nonfinite
    if max_consecutive is not None:
      skip = nonfinite & (state.consecutive < max_consecutive)
    out = jax.tree.map(lambda u: jnp.where(skip, jnp.zeros_like(u), u), new_updates)
    inner_state = jax.tree.map(lambda old, new: jnp.where(skip, old, new),
                               state.inner_state, new_inner)
    skipped = state.skipped + skip.astype(jnp.int32)
    consecutive = jnp.where(skip, state.consecutive + 1, 0).astype(jnp.int32)
    return out, SkipNonFiniteState(skipped, consecutive, inner_state)

  return optax.GradientTransformation(init_fn, update_fn)
