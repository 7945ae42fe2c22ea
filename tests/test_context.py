"""Global (jit-with-sharding) steps: `jax.jit` over global arrays under `jax.set_mesh(jdist.mesh())`.

The same reference as the per-replica API: every process holds its rows of
the global batch as one array sharded over its mesh, and the job must train
like one device on the whole global batch (1x4, 2x1 and 2x2).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdist
from jdist import collectives
from jdist import errors
from jdist.collectives import routes
from tests import jaxpr_graph
from tests import reference

PER_REPLICA = 4
STEPS = 5


def _global_step(model, tx):
  """What a user writes: jit, global arrays, no device axis anywhere."""
  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: reference.loss_fn(model, p, x, y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss)
  return step


def _train_global(model, params, tx, batches, steps):
  mesh = jdist.mesh()
  replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(jdist.DATA_AXIS))
  step = _global_step(model, tx)
  with jax.set_mesh(mesh):
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    losses = []
    for i in range(steps):
      x, y = jax.device_put(jdist.process_slice(batches[i % len(batches)]), sharded)
      params, opt_state, loss = step(params, opt_state, x, y)
      losses.append(loss)
  return params, losses


def _batches(topo):
  return [reference.global_batch(topo.replica_count, PER_REPLICA, seed=s) for s in range(3)]


@pytest.mark.parametrize("name,inner,rtol", [
    ("sgd_momentum", lambda: optax.sgd(0.1, momentum=0.9), 1e-5),
    ("adam", lambda: optax.adam(0.01), 1e-4),
])
def test_global_step_trains_like_one_device_on_the_whole_batch(topo, name, inner, rtol):
  del name
  model, batches = reference.TinyMLP(), _batches(topo)
  params = model.init(jax.random.key(0), batches[0][0][:1])
  expected = reference.train_reference(model, params, inner(), batches, STEPS)
  trained, losses = _train_global(model, params, jdist.dist_opt(inner()), batches, STEPS)
  reference.assert_trees_close(trained, expected, rtol=rtol, atol=1e-6)
  # Outputs a user reads come back without a device axis.
  assert losses[-1].shape == () and np.isfinite(float(losses[-1]))
  first = reference.loss_fn(model, params, *batches[0])
  np.testing.assert_allclose(float(losses[0]), float(first), rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_global_step_16bit_matches_float32_within_16bit_tolerance(topo, dtype):
  model, batches = reference.TinyMLP(), _batches(topo)
  params = model.init(jax.random.key(0), batches[0][0][:1])
  expected = reference.train_reference(model, params, optax.sgd(0.1), batches, STEPS)
  trained, _ = _train_global(model, params, jdist.dist_opt(optax.sgd(0.1), half=dtype),
                             batches, STEPS)
  reference.assert_trees_close(trained, expected, rtol=2e-2, atol=2e-3)


def test_global_step_full_topk_is_plain_averaging(topo):
  model, batches = reference.TinyMLP(), _batches(topo)
  params = model.init(jax.random.key(0), batches[0][0][:1])
  expected = reference.train_reference(model, params, optax.sgd(0.1), batches, STEPS)
  trained, _ = _train_global(model, params, jdist.dist_opt(optax.sgd(0.1), sparsify="topk:1.0"),
                             batches, STEPS)
  reference.assert_trees_close(trained, expected, rtol=1e-5, atol=1e-6)


def test_a_global_steps_gathered_payload_crosses_processes_once_per_process(topo):
  # A global step holds one value per process: a top-K payload leaves each
  # process once (1/D from each local device), not once per device.
  mesh = jdist.mesh()
  tx = jdist.dist_opt(optax.sgd(0.1), sparsify="topk:0.25")
  params = {"w": jnp.zeros((64,))}
  grads = {"w": jnp.arange(64, dtype=jnp.float32)}
  with jax.set_mesh(mesh):
    params, grads = jax.device_put((params, grads), NamedSharding(mesh, P()))
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    sent = float(jdist.wire_bytes(state))
  payload = 16 * (4 + 4)  # 16 float32 values and their int32 indices
  devices = topo.local_device_count
  assert sent == (topo.process_count - 1) * devices * -(-payload // devices)


def test_reductions_of_a_global_step_run_in_trace_order_on_the_callback_route(topo):
  # Each reduction of a global step is a shard_map of its own. The gradients'
  # top-K gather and the loss's mean are independent, and where each
  # device's exchange blocks an XLA thread in MPI (the callback route, where
  # jdist.init(route="callback") chooses it), two processes running them in different orders
  # wait for each other forever. The second must read the first's output.
  # Traced only, on a callback route built for the trace and passed
  # explicitly, so every topology checks it: the gradients' gather (as a
  # top-K payload's) and the loss's mean.
  model, batches = reference.TinyMLP(), _batches(topo)
  params = model.init(jax.random.key(0), batches[0][0][:1])
  on_callback = collectives.on_route(routes.CallbackRoute(topo, world=None))

  @jax.jit
  def step(params, x, y):
    loss, grads = jax.value_and_grad(lambda p: reference.loss_fn(model, p, x, y))(params)
    return on_callback.all_gather(grads), on_callback.pmean(loss)

  mesh = jdist.mesh()
  with jax.set_mesh(mesh):
    x, y = jax.device_put(jdist.process_slice(batches[0]), NamedSharding(mesh, P(jdist.DATA_AXIS)))
    traced = jax.make_jaxpr(step)(params, x, y)
  step = jaxpr_graph.find_body(traced, "shard_map")
  reductions = jaxpr_graph.equations(step, "shard_map")
  assert len(reductions) == 2  # the gradients' exchange, then the loss's mean
  assert jaxpr_graph.depends_on(step, reductions[1], reductions[0])
  for reduction in reductions:
    body = jaxpr_graph.find_body(reduction.params["jaxpr"], "jdist_cross_process")
    assert all(isinstance(e.params["route"], routes.CallbackRoute)
               for e in jaxpr_graph.equations(body, "jdist_cross_process"))


def test_reductions_in_a_global_step_combine_one_value_per_process(topo):
  mesh = jdist.mesh()
  reference.assert_reductions_combine_one_value_per_process(mesh, P(), 2, topo)


def test_jit_without_a_mesh_names_both_ways_in(topo):
  del topo
  tx = jdist.dist_opt(optax.sgd(0.1))
  params = jnp.ones(3)
  with pytest.raises(errors.CollectiveContextError) as info:
    jax.jit(lambda p, s: tx.update(p, s, p))(params, tx.init(params))
  message = str(info.value)
  assert "@jdist.data_parallel" in message and "jax.set_mesh(jdist.mesh())" in message


def test_global_step_partial_sync_of_one_chunk_is_plain_averaging(topo):
  model, batches = reference.TinyMLP(), _batches(topo)
  params = model.init(jax.random.key(0), batches[0][0][:1])
  expected = reference.train_reference(model, params, optax.sgd(0.1), batches, STEPS)
  trained, _ = _train_global(model, params, jdist.dist_opt(optax.sgd(0.1), partial=1),
                             batches, STEPS)
  reference.assert_trees_close(trained, expected, rtol=1e-5, atol=1e-6)
