"""A branch taken on some steps only, with nothing copied on the others.

DiLoCo and local SGD exchange on a few steps and leave their state as it is
on every other one. Written as `lax.switch(index, [identity, *branches],
...)`, every array the identity branch returns is copied each step: XLA's
copy insertion puts a copy at each branch's root, and keeps it when the
operand is live past the conditional or is a step input (for the SINGA CNN's
DiLoCo step, three 1.6 MB copies per step). A `lax.while_loop` of at most
one trip carries its operands in place instead: a step whose index is 0
runs no trip and touches none of them (step inputs still need the step to
donate them: `jdist.data_parallel(donate_argnums=...)`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def switch_or_keep(index: jax.Array, branches: Sequence[Callable[..., Any]], carry: Any,
                   *operands: Any) -> Any:
  """`branches[index - 1](carry, *operands)` where `index > 0`; `carry` itself where 0.

  Args:
    index: an int32 scalar, the same on every replica: 0 (nothing to do) or 1
      + the branch to take.
    branches: functions `(carry, *operands) -> new carry`, each returning
      the leaves of `carry` (any container types) in its order, shapes and
      dtypes.
    carry: the pytree of arrays that a branch may change.
    *operands: what the branches read and do not return.

  Returns:
    The new carry, with `carry`'s structure.

  Raises:
    ValueError: a branch returns another number of leaves than `carry` has
      (at trace time).
  """
  leaves, treedef = jax.tree.flatten(carry)

  def take(branch, trip_leaves):
    new = jax.tree.leaves(branch(jax.tree.unflatten(treedef, trip_leaves), *operands))
    if len(new) != len(trip_leaves):
      raise ValueError(f"{getattr(branch, '__name__', branch)!r} returned {len(new)} arrays "
                       f"where its carry has {len(trip_leaves)}.")
    return [jnp.asarray(value, old.dtype) for value, old in zip(new, trip_leaves)]

  def body(loop):
    trips, trip_leaves = loop
    if len(branches) == 1:
      return trips + 1, take(branches[0], trip_leaves)
    return trips + 1, lax.switch(index - 1, [
        (lambda values, branch=branch: take(branch, values)) for branch in branches],
        trip_leaves)

  due = jnp.minimum(jnp.asarray(index, jnp.int32), 1)
  _, leaves = lax.while_loop(lambda loop: loop[0] < due, body, (jnp.int32(0), leaves))
  return jax.tree.unflatten(treedef, leaves)
