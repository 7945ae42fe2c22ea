"""gated.switch_or_keep: lax.switch with an identity branch 0, without its copies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.transforms import gated


def _branches():
  return [lambda carry, scale: ([carry[0][0] * scale], carry[1] + 1),
          lambda carry, scale: ([carry[0][0] - scale], carry[1] + 10)]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_same_results_as_lax_switch_with_an_identity_branch(index):
  carry = ([jnp.arange(6.0).reshape(2, 3)], jnp.int32(5))
  scale = jnp.float32(3.0)
  got = jax.jit(lambda i, c, s: gated.switch_or_keep(i, _branches(), c, s))(
      jnp.int32(index), carry, scale)
  want = jax.lax.switch(index, [lambda c, s: c] + _branches(), carry, scale)
  assert jax.tree.structure(got) == jax.tree.structure(carry)
  for value, expected in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(value, expected)
    assert value.dtype == expected.dtype


def test_one_branch_runs_where_index_is_positive():
  step = jax.jit(lambda i, x: gated.switch_or_keep(i, [lambda c: c * 2.0], x))
  np.testing.assert_array_equal(step(jnp.int32(0), jnp.ones(3)), np.ones(3))
  np.testing.assert_array_equal(step(jnp.int32(1), jnp.ones(3)), np.full(3, 2.0))


def test_a_branch_returning_another_carry_is_refused():
  with pytest.raises(ValueError, match="returned 2 arrays where its carry has 1"):
    gated.switch_or_keep(jnp.int32(1), [lambda c: (c, c)], jnp.ones(2))
