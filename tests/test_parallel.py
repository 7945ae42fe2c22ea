"""data_parallel and the placement helpers."""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist import errors
from tests import launch


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


def test_shape_error_advice_works_as_written(topo):
  """The ShapeError for an unsharded batch says jdist.shard(batch); that call works."""
  step = jdist.data_parallel(lambda x: jdist.pmean(x.sum()))
  batch = np.ones((topo.local_device_count * 2, 3), np.float32)
  with pytest.raises(errors.ShapeError) as info:
    step(batch)
  assert "jdist.shard(batch)" in str(info.value)
  np.testing.assert_allclose(step(jdist.shard(batch)), np.full(topo.local_device_count, 6.0))


def test_step_left_under_jit_names_data_parallel_and_the_advice_works(topo):
  tx = jdist.dist_opt(optax.sgd(0.1))

  def train_step(params, opt_state, x):
    grads = jax.grad(lambda p: jnp.mean((x @ p) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, x = jnp.ones((3,)), np.ones((topo.local_device_count * 2, 3), np.float32)
  with pytest.raises(errors.CollectiveContextError) as info:
    jax.jit(train_step)(params, tx.init(params), x)
  message = str(info.value)
  assert "jdist.dist_opt" in message and "@jdist.data_parallel instead" in message
  assert "jdist.replicate(" in message and "jdist.shard(batch)" in message
  # The advice, as written: data_parallel, replicated state, a sharded batch.
  step = jdist.data_parallel(train_step)
  new_params, _ = step(jdist.replicate(params), jdist.replicate(tx.init(params)), jdist.shard(x))
  # Every replica holds the same rows' mean gradient, so one device on the
  # whole batch is the reference.
  expected = params - 0.1 * jax.grad(lambda p: jnp.mean((x @ p) ** 2))(params)
  np.testing.assert_allclose(jdist.unreplicate(new_params), expected, rtol=1e-6)


def test_decorating_initializes_nothing_subprocess():
  """A module-level @jdist.data_parallel leaves the documented jdist.init(timeout=600) free."""
  script = textwrap.dedent("""
      import numpy as np
      import jdist
      from jdist.runtime import job

      @jdist.data_parallel
      def step(x):
        return jdist.pmean(x)

      assert not job.is_initialized(), "decorating initialized jdist"
      topo = jdist.init(timeout=600)
      assert topo.timeout == 600, topo.timeout
      print("sum", float(step(np.ones((topo.local_device_count, 2), np.float32)).sum()))
  """)
  done = subprocess.run([sys.executable, "-c", script], env=launch.clean_env(devices=2),
                        capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "sum 4.0" in done.stdout


def test_outputs_a_user_reads_come_back_without_the_device_axis(topo):
  @jdist.data_parallel(out_axes=(0, None))
  def step(x):
    return x * 2, jdist.pmean(jnp.sum(x))

  x = np.arange(topo.local_device_count * 3, dtype=np.float32).reshape(-1, 3)
  doubled, loss = step(x)
  assert doubled.shape == x.shape and loss.shape == ()
  # Every process feeds the same x here, so the mean over replicas is local.
  np.testing.assert_allclose(float(loss), x.sum(axis=1).mean(), rtol=1e-6)
  assert "%.4f" % loss  # what flax's examples print: only a scalar formats
  with pytest.raises(ValueError, match="out_axes="):
    jdist.data_parallel(lambda x: x, out_axes=1)


def test_helpers_work_under_the_global_mesh(topo):
  """The README sets `jax.set_mesh(jdist.mesh())`; the host helpers still work under it."""
  tree = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(7)}
  on_last = jax.device_put(tree, jax.local_devices()[-1])  # committed to one device

  @jdist.data_parallel
  def step(x):
    return jax.tree.map(lambda a: a + jdist.pmean(jnp.ones_like(a)), x)

  jax.set_mesh(jdist.mesh())
  try:
    replicated = jdist.replicate(on_last)
    back = jdist.unreplicate(replicated)
    again = jdist.replicate(back)  # an unreplicated (one-device) array, replicated again
    stepped = jdist.unreplicate(step(jdist.replicate(jdist.unreplicate(again))))
    synced = jdist.unreplicate(jdist.sync_params(again))
  finally:
    jax.set_mesh(None)
  np.testing.assert_array_equal(back["w"], tree["w"])
  assert int(back["step"]) == 7 and again["w"].shape == (topo.local_device_count, 2, 3)
  np.testing.assert_array_equal(stepped["w"], tree["w"] + 1)
  np.testing.assert_array_equal(stepped["step"], 8)
  np.testing.assert_array_equal(synced["w"], tree["w"])


# Every jdist file a data_parallel step with one psum may run code in, traced,
# compiled and called once (issue 37 counted 19 before the job object): the
# step wrapper, the collective op, its context and fusion, the route and its
# engine, the job with the trace-time structure check (a host exchange under
# the watchdog, which the flight recorder notes) and the exchange's label.
# With JAX's persistent cache on (as the suite runs), a cache miss also runs
# the hook that lets every rank write its own programs there.
_PSUM_PATH = {"parallel.py", "fusion.py", "collectives/ops.py", "collectives/context.py",
              "collectives/routes/base.py", "collectives/routes/local.py",
              "collectives/routes/mpi4jax.py", "collectives/native/__init__.py",
              "runtime/job.py", "runtime/world.py", "runtime/watchdog.py",
              "runtime/flight_recorder.py"}


def test_a_psum_step_runs_code_in_at_most_ten_jdist_modules(topo):
  root = os.path.dirname(jdist.__file__)
  ran = set()

  def profile(frame, event, arg):
    del arg
    if event == "call" and frame.f_code.co_filename.startswith(root):
      ran.add(os.path.relpath(frame.f_code.co_filename, root))

  @jdist.data_parallel
  def step(x):
    return jdist.psum(x * 2.0)

  batch = jdist.shard(np.ones((topo.local_device_count * 2, 3), np.float32))
  threading.setprofile(profile)
  sys.setprofile(profile)
  try:
    out = jax.block_until_ready(step(batch))
  finally:
    sys.setprofile(None)
    threading.setprofile(None)
  np.testing.assert_allclose(np.asarray(out), 2.0 * topo.replica_count)
  if jax.config.jax_compilation_cache_dir:
    ran.discard("runtime/jax_internals.py")
  assert ran <= _PSUM_PATH, sorted(ran - _PSUM_PATH)
  assert len(ran) <= 10, sorted(ran)
