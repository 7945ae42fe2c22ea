"""data_parallel and the placement helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import errors


def test_mapped_input_with_wrong_leading_size_is_a_clear_error(topo):
  step = jdist.data_parallel(lambda x: x * 2)
  devices = topo.local_device_count
  with pytest.raises(errors.ShapeError, match=f"leading size {devices + 1}") as info:
    step(np.ones((devices + 1, 3)))
  assert "jdist.shard" in str(info.value) and f"{devices} local devices" in str(info.value)
  with pytest.raises(errors.ShapeError, match="a scalar"):
    step(np.float32(1.0))
  np.testing.assert_array_equal(step(np.ones((devices, 3))), np.full((devices, 3), 2.0))


def test_unmapped_and_static_arguments_pass_through(topo):
  devices = topo.local_device_count

  @jdist.data_parallel(in_axes=(0, None), static_broadcasted_argnums=(2,))
  def step(x, shared, power):
    return x ** power + shared

  out = step(np.full((devices, 2), 3.0), np.float32(1.0), 2)
  np.testing.assert_array_equal(out, np.full((devices, 2), 10.0))


def test_replicate_unreplicate_round_trip(topo):
  tree = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(7)}
  replicated = jdist.replicate(tree)
  assert replicated["w"].shape == (topo.local_device_count, 2, 3)
  assert len(replicated["w"].addressable_shards) == topo.local_device_count
  back = jdist.unreplicate(replicated)
  np.testing.assert_array_equal(back["w"], tree["w"])
  assert int(back["step"]) == 7
  copies = jdist.local_replicas(replicated)
  assert len(copies) == topo.local_device_count
  np.testing.assert_array_equal(copies[-1]["w"], tree["w"])


def test_donated_step_runs_repeatedly(topo):
  @jdist.data_parallel(donate_argnums=(0,))
  def step(x):
    return x + jdist.pmean(jnp.ones_like(x))

  x = jdist.replicate(jnp.zeros(4))
  for _ in range(5):
    x = step(x)
  np.testing.assert_allclose(jdist.unreplicate(x), np.full(4, 5.0))
