"""`jdist.mesh(model=K)`: a model axis within each process beside the data axis.

A jit step over the two-axis mesh, with the MLP's kernels sharded over the
model axis and the batch over the data axis, must train like one device on
the whole global batch: 1x4 (2 data x 2 model in one process), 2x2 (each
process one data slot x 2 model devices, the data axis across processes)
and 2x1 (model=1: the two-axis mesh with a model axis of one device).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jdist
from jdist import errors
from tests import reference

PER_REPLICA = 2
STEPS = 3


def _model_size(topo) -> int:
  return 2 if topo.local_device_count % 2 == 0 else 1


def _specs(model_axis):
  """reference.TinyMLP's (Dense_0 64 -> 32, Dense_1 32 -> 10), Megatron-style: the
  first kernel split by columns, the second by rows."""
  return {"params": {
      "Dense_0": {"kernel": P(None, model_axis), "bias": P(model_axis)},
      "Dense_1": {"kernel": P(model_axis, None), "bias": P()}}}


def _train_sharded(model, params, tx, batches, mesh, data_axis, model_axis):
  specs = _specs(model_axis)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda s: isinstance(s, P))
  batch_sharding = NamedSharding(mesh, P(data_axis))

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: reference.loss_fn(model, p, x, y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss)

  with jax.set_mesh(mesh):
    params = jax.device_put(params, shardings)
    opt_state = tx.init(params)
    losses = []
    for i in range(STEPS):
      x, y = jax.device_put(jdist.process_slice(batches[i % len(batches)]), batch_sharding)
      params, opt_state, loss = step(params, opt_state, x, y)
      losses.append(loss)
  return params, losses, shardings


def _inner():
  return optax.sgd(0.1, momentum=0.9)


@functools.cache
def _reference(replicas: int):
  """The model, its batches and initial parameters, and one device's training on them."""
  model = reference.TinyMLP()
  batches = [reference.global_batch(replicas, PER_REPLICA, seed=s) for s in range(2)]
  params = model.init(jax.random.key(0), batches[0][0][:1])
  return model, batches, params, reference.train_reference(model, params, _inner(), batches,
                                                           STEPS)


@pytest.mark.parametrize("names,options,rtol,atol", [
    (("batch", "model"), {}, 1e-5, 1e-6),           # the miniGPT tutorial's axis names
    (None, {"half": True}, 2e-2, 2e-3),             # (jdist.DATA_AXIS, "model"), 16-bit
    (None, {"sparsify": "topk:1.0"}, 1e-5, 1e-6),   # a compressed payload: whole values
])
def test_model_axis_step_trains_like_one_device_on_the_whole_batch(topo, names, options,
                                                                   rtol, atol):
  model_size = _model_size(topo)
  if names is None and model_size == 1:  # model=1 alone is the one-axis mesh
    names = (jdist.DATA_AXIS, "model")
  mesh = jdist.mesh(model=model_size, names=names)
  data_axis, model_axis = mesh.axis_names
  assert names is not None or mesh.axis_names == (jdist.DATA_AXIS, "model")
  assert mesh.shape == {data_axis: topo.local_device_count // model_size,
                        model_axis: model_size}
  model, batches, params, expected = _reference(topo.replica_count)
  trained, losses, shardings = _train_sharded(model, params, jdist.dist_opt(_inner(), **options),
                                              batches, mesh, data_axis, model_axis)
  reference.assert_trees_close(trained, expected, rtol=rtol, atol=atol)
  # The parameters stay sharded over the model axis.
  for leaf, sharding in zip(jax.tree.leaves(trained), jax.tree.leaves(shardings)):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
  first = reference.loss_fn(model, params, *batches[0])
  np.testing.assert_allclose(float(losses[0]), float(first), rtol=1e-5)


def test_reductions_over_a_model_mesh_combine_one_value_per_process(topo):
  mesh = jdist.mesh(model=_model_size(topo), names=("batch", "model"))
  reference.assert_reductions_combine_one_value_per_process(mesh, P("model"), 4, topo)


def test_model_one_without_names_is_the_one_axis_mesh(topo):
  assert jdist.mesh(model=1).axis_names == (jdist.DATA_AXIS,)
  assert jdist.mesh(model=1).devices.size == len(jax.local_devices())
  del topo


@pytest.mark.parametrize("model,names,fragment", [
    (0, None, "model=0 must be a positive int"),
    (True, None, "model=True must be a positive int"),
    (5, None, "model=5 is more than this process's"),
    (None, None, "must be a positive int"),
    (1, ("model",), "must be two different axis names"),
    (1, ("batch", "batch"), "must be two different axis names"),
    (1, ("batch", jdist.DATA_AXIS), "names the model axis 'data'"),
])
def test_bad_arguments_name_the_argument_and_the_fix(topo, model, names, fragment):
  del topo
  with pytest.raises(ValueError) as info:
    jdist.mesh(model=model, names=names)
  assert fragment in str(info.value)


def test_model_that_does_not_divide_the_local_devices_names_the_choices(topo):
  if topo.local_device_count < 3:
    pytest.skip("every model size up to the local device count divides it")
  with pytest.raises(ValueError) as info:
    jdist.mesh(model=3)
  assert "model=3 does not divide" in str(info.value) and "(1, 2, 4)" in str(info.value)


def test_a_two_axis_mesh_jdist_did_not_build_is_a_clear_error(topo):
  del topo
  devices = np.asarray(jax.local_devices())
  own = jax.sharding.Mesh(devices.reshape(-1, 1), (jdist.DATA_AXIS, "expert"))
  with jax.set_mesh(own):
    with pytest.raises(errors.CollectiveContextError) as info:
      jax.jit(jdist.psum)(jnp.ones(2))
  assert "jdist.mesh(model=K)" in str(info.value)


def test_a_data_parallel_step_under_a_model_mesh_says_it_has_no_model_axis(topo):
  step = jdist.data_parallel(jdist.pmean)
  values = jnp.ones((topo.local_device_count, 2))
  with jax.set_mesh(jdist.mesh(model=_model_size(topo), names=("batch", "model"))):
    with pytest.raises(errors.CollectiveContextError) as info:
      step(values)
  assert "model axis 'model'" in str(info.value) and "jax.jit step" in str(info.value)
  np.testing.assert_allclose(step(values), values)  # outside the mesh it runs as ever
