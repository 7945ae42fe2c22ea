"""What acts per process in a jit step over global arrays, and each one-line fix.

In the jit style (docs/styles.md, "What acts per process"), a process's step
sees its own rows of the global batch; `jdist.dist_opt` averages the
processes' gradients after the step. Each test trains the fixed program
against one device on the whole global batch (float tolerance) and, where
the mistake shows in this topology, checks that the unfixed one does not
match:

* gradient clipping written in the step clips each process's gradient:
  clip inside `jdist.dist_opt(...)` (or after `jdist.allreduce()`);
* a loss term on a batch statistic (a penalty on the batch mean of the
  input gradients) sees each process's rows only: take the statistic over
  the global batch with `jdist.pmean`;
* noise drawn on the host for the whole global batch is sharded with it and
  is already right; `jdist.replica_key` inside the step would break it.

And an NNX program with second-order gradients (a per-example gradient
penalty: `jax.grad` of a loss holding the norm of an input gradient) trains
as one device does. Every test runs in 1x4, 2x1 and 2x2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdist

PER_REPLICA = 4
FEATURES = 6
HIDDEN = 8
STEPS = 3
LR = 0.1


def _batches(topo, steps=STEPS, seed=0):
  """Global batches, the same on every process: x [G, FEATURES], y [G, 1]."""
  rng = np.random.default_rng(seed)
  rows = topo.replica_count * PER_REPLICA
  out = []
  for _ in range(steps):
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = (np.sin(x.sum(axis=1, keepdims=True)) + 0.1 * rng.normal(size=(rows, 1))).astype(
        np.float32)
    out.append({"x": x, "y": y})
  return out


def _init(seed=1):
  rng = np.random.default_rng(seed)
  return {"w1": (rng.normal(size=(FEATURES, HIDDEN)) * 0.7).astype(np.float32),
          "b1": (rng.normal(size=HIDDEN) * 0.1).astype(np.float32),
          "w2": (rng.normal(size=(HIDDEN, 1)) * 0.7).astype(np.float32),
          "b2": np.zeros(1, np.float32)}


def _predict(params, x):
  return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def _mse(params, batch, x=None):
  x = batch["x"] if x is None else x
  return jnp.mean((_predict(params, x) - batch["y"]) ** 2)


def _one_device(loss_fn, tx, batches, params=None):
  """The reference: one device, the whole global batch each step."""
  params = jax.tree.map(jnp.asarray, _init() if params is None else params)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  for batch in batches:
    params, opt_state = step(params, opt_state, batch)
  return jax.tree.map(np.asarray, params)


def _jit_style(loss_fn, tx, batches, *, in_step=None):
  """The README's jit step over global arrays: this process's rows, then `tx`.

  `in_step(grads)`, if given, runs on the gradients in the step, before `tx`.
  """
  params = jax.tree.map(jnp.asarray, _init())
  with jax.set_mesh(jdist.mesh()):
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      if in_step is not None:
        grads = in_step(grads)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    for batch in batches:
      params, opt_state = step(params, opt_state, jdist.shard_global_batch(batch))
  return jax.tree.map(np.asarray, params)


def _assert_close(got, expected, rtol=1e-5, atol=1e-6):
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=rtol, atol=atol, err_msg=name)


def _differs(got, expected, by=1e-4):
  return max(float(np.max(np.abs(got[name] - expected[name]))) for name in expected) > by


# --- gradient clipping --------------------------------------------------------

MAX_NORM = 0.05  # well below the gradients' norms: clipping acts every step


def _clip(grads):
  return optax.clip_by_global_norm(MAX_NORM).update(grads, optax.EmptyState())[0]


@pytest.mark.parametrize("fixed", ["inside_dist_opt", "after_allreduce"])
def test_clipping_the_averaged_gradient_matches_one_device(topo, fixed):
  batches = _batches(topo)
  expected = _one_device(_mse, optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.sgd(LR)),
                         batches)
  if fixed == "inside_dist_opt":
    tx = jdist.dist_opt(optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.sgd(LR)))
  else:
    tx = optax.chain(jdist.allreduce(), optax.clip_by_global_norm(MAX_NORM), optax.sgd(LR))
  _assert_close(_jit_style(_mse, tx, batches), expected)
  # Clipped in the step: each process's own gradient, before the average.
  per_process = _jit_style(_mse, jdist.dist_opt(optax.sgd(LR)), batches, in_step=_clip)
  if topo.process_count > 1:
    assert _differs(per_process, expected)
  else:
    _assert_close(per_process, expected)  # one process: its gradient is the whole batch's


# --- a loss term on a batch statistic -----------------------------------------

PENALTY = 0.5


def _mean_input_gradient_penalty(reduce):
  """MSE + PENALTY * |the batch mean of d f / d x|^2 (a statistic of the batch)."""
  def loss(params, batch):
    input_grads = jax.grad(lambda x: _predict(params, x).sum())(batch["x"])  # [rows, FEATURES]
    mean = reduce(jnp.mean(input_grads, axis=0))
    return _mse(params, batch) + PENALTY * jnp.sum(mean ** 2)
  return loss


def test_a_penalty_on_the_global_batch_mean_matches_one_device(topo):
  batches = _batches(topo)
  expected = _one_device(_mean_input_gradient_penalty(lambda m: m), optax.sgd(LR), batches)
  tx = jdist.dist_opt(optax.sgd(LR))
  _assert_close(_jit_style(_mean_input_gradient_penalty(jdist.pmean), tx, batches), expected)
  # Over each process's rows only: the mean of P sub-batch penalties.
  local = _jit_style(_mean_input_gradient_penalty(lambda m: m), tx, batches)
  if topo.process_count > 1:
    assert _differs(local, expected)
  else:
    _assert_close(local, expected)


# --- noise --------------------------------------------------------------------

NOISE = 0.3


def _noisy_mse(params, batch):
  return _mse(params, batch, x=batch["x"] + NOISE * batch["noise"])


def test_noise_drawn_on_the_host_for_the_global_batch_matches_one_device(topo):
  batches = _batches(topo)
  rng = np.random.default_rng(5)
  for batch in batches:  # the same global draw on every process
    batch["noise"] = rng.normal(size=batch["x"].shape).astype(np.float32)
  expected = _one_device(_noisy_mse, optax.sgd(LR), batches)
  tx = jdist.dist_opt(optax.sgd(LR))
  _assert_close(_jit_style(_noisy_mse, tx, batches), expected)

  # jdist.replica_key in the step draws other noise than the global batch's.
  def replica_noise(params, batch):
    noise = jax.random.normal(jdist.replica_key(jax.random.key(5)), batch["x"].shape)
    return _mse(params, batch, x=batch["x"] + NOISE * noise)

  stripped = [{"x": b["x"], "y": b["y"]} for b in batches]
  assert _differs(_jit_style(replica_noise, tx, stripped), expected)


# --- NNX, second-order gradients ----------------------------------------------

class _Net(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


def _gradient_penalty_loss(model, batch):
  """MSE + PENALTY * mean_i (|d f(x_i) / d x_i| - 1)^2: jax.grad inside the loss."""
  input_grads = jax.grad(lambda x: model(x).sum())(batch["x"])
  norms = jnp.sqrt(jnp.sum(input_grads ** 2, axis=1) + 1e-12)
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2) + PENALTY * jnp.mean((norms - 1) ** 2)


def test_nnx_gradient_penalty_in_a_jit_step_matches_one_device(topo):
  batches = _batches(topo, steps=4)
  reference = _Net(nnx.Rngs(0))
  ref_optimizer = nnx.Optimizer(reference, optax.sgd(LR, momentum=0.9), wrt=nnx.Param)

  @nnx.jit
  def ref_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_gradient_penalty_loss)(model, batch)
    optimizer.update(model, grads)
    return loss

  expected = [float(ref_step(reference, ref_optimizer, batch)) for batch in batches]

  model = _Net(nnx.Rngs(0))  # the same seed everywhere: equal parameters
  optimizer = nnx.Optimizer(model, jdist.dist_opt(optax.sgd(LR, momentum=0.9)), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_gradient_penalty_loss)(model, batch)
    optimizer.update(model, grads)
    return jdist.pmean(loss)

  with jax.set_mesh(jdist.mesh()):
    losses = [float(step(model, optimizer, jdist.shard_global_batch(batch)))
              for batch in batches]
  np.testing.assert_allclose(losses, expected, rtol=1e-5)
  got, want = nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param)
  for leaf, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(leaf), np.asarray(ref), rtol=1e-5, atol=1e-6)
