"""start_check: the parameter fingerprint every process compares at the first tx.init."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.runtime import start_check


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8])
def test_fingerprint_reads_every_dtype_and_tells_values_apart(dtype, topo):
  del topo  # jdist.init() before the first array, when this file runs alone under mpirun
  tree = {"w": jnp.arange(6).reshape(2, 3).astype(dtype), "s": jnp.asarray(3, dtype)}
  same = {"w": jnp.arange(6).reshape(2, 3).astype(dtype), "s": jnp.asarray(3, dtype)}
  other = {"w": jnp.arange(6).reshape(2, 3).astype(dtype), "s": jnp.asarray(4, dtype)}
  assert start_check.fingerprint(tree) == start_check.fingerprint(same)
  assert start_check.fingerprint(tree) != start_check.fingerprint(other)
  reshaped = {"w": jnp.arange(6).reshape(3, 2).astype(dtype), "s": jnp.asarray(3, dtype)}
  assert start_check.fingerprint(tree) != start_check.fingerprint(reshaped)


def test_dist_opt_starts_from_bfloat16_parameters(topo):
  # Every process compares the parameters' fingerprints at the first tx.init.
  params = {"w": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.zeros(3, jnp.float32)}
  tx = jdist.dist_opt(optax.sgd(0.1, momentum=0.9))
  state = tx.init(params)
  step = jdist.data_parallel(lambda g, s, p: tx.update(g, s, p)[0])
  updates = jdist.unreplicate(step(*(jdist.replicate(t) for t in (params, state, params))))
  assert updates["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(updates["w"], np.float32), -0.1, rtol=1e-2)


class _CountingWorld:
  """Stands in for the MPI world: records each comparison, every rank agreeing."""
  size = 2

  def __init__(self):
    self.compared = []

  def allgather_object(self, value, what):
    self.compared.append(what)
    return [value, value]


def test_each_init_compares_once_and_never_by_memory_address(monkeypatch):
  world = _CountingWorld()
  monkeypatch.setattr(start_check.job_lib, "world", lambda: world)
  params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
  tx = jdist.dist_opt(optax.sgd(0.1))  # its chain holds jdist.allreduce: one comparison for both
  tx.init(params)
  assert world.compared == ["jdist.dist_opt: comparing initial parameters"]
  # The same leaves again: compared again. Skipping by id() made one rank skip
  # when the allocator reused an address, and the ranks' host exchanges went
  # out of step (a 2x1 suite run: the next test's exchange paired with it).
  tx.init(params)
  assert len(world.compared) == 2
  jdist.allreduce().init(params)  # alone, not inside another jdist init
  assert world.compared[-1] == "jdist.allreduce: comparing initial parameters"
  assert len(world.compared) == 3
