"""Differentiating through jdist's reductions, against one device on the whole batch.

The reference semantics is XLA's own collectives in one process (1 x N):
the transpose of a sum over replicas is a sum over replicas (`lax.psum`'s in
a pmap). So on every replica the gradient of `jdist.pmean(local mean loss)`
is the gradient of its own local loss, and their average over replicas (what
`jdist.allreduce` takes) is one device's gradient on the whole batch; the
JVP of that loss is the whole batch's directional derivative. In a jit step
over global arrays a process is one participant: the same holds per process.
Every test runs in 1 x 4, 2 x 1 and 2 x 2, each multi-process route the
topology allows in turn (native, mpi4jax with one device per process,
callback).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jdist
from jdist import collectives
from jdist.collectives import native
from tests import reference

PER_REPLICA = 4
FEATURES = 3
HIDDEN = 4
SCALES = np.array([1.0, 0.5, -0.25], np.float32)  # lax.scan's steps
W0 = np.array([0.3, -0.2, 0.5], np.float32)
TANGENT = np.array([1.0, 2.0, -1.0], np.float32)
TOL = dict(rtol=1e-5, atol=1e-6)


def _data(topo):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(topo.replica_count * PER_REPLICA, FEATURES)).astype(np.float32)
  y = rng.normal(size=(topo.replica_count * PER_REPLICA,)).astype(np.float32)
  return x, y


def _mean_loss(w, x, y):
  return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def _ensemble():
  return np.stack([W0, -W0, 2 * W0])  # jax.vmap's axis: three parameter vectors


def _routes(topo):
  """Each multi-process route this topology can take (the local route in one process)."""
  if topo.process_count == 1:
    return [None]
  names = (["native"] if native.running() else []) + ["callback"]
  return names + (["mpi4jax"] if topo.local_device_count == 1 else [])


def _reductions(name):
  """jdist's reductions on route `name` (the job's for None), passed explicitly."""
  return jdist if name is None else collectives.on_route(name)


def _quantities(w, x, y, a, r=jdist):
  """Everything these tests differentiate, computed in either kind of step.

  `x, y` are this participant's rows (a replica's, or a process's in a jit
  step); `a` weighs the rows of `jdist.all_gather`; `r` offers the
  reductions (`jdist`, or `jdist.collectives.on_route(name)`).
  """
  loss_fn = lambda w: r.pmean(_mean_loss(w, x, y))
  loss, grad = jax.value_and_grad(loss_fn)(w)
  _, tangent = jax.jvp(loss_fn, (w,), (jnp.asarray(TANGENT),))
  ensemble_grads = jax.vmap(jax.grad(loss_fn))(jnp.asarray(_ensemble()))
  grad_of_vmap = jax.grad(lambda w: jnp.sum(jax.vmap(loss_fn)(w)))(jnp.asarray(_ensemble()))

  def scanned(w):
    body = lambda total, s: (total + r.pmean(_mean_loss(w * s, x, y)), None)
    return jax.lax.scan(body, 0.0, jnp.asarray(SCALES))[0]

  grad_of_scan = jax.grad(scanned)(w)

  def sgd(w, _):  # training steps inside lax.scan, each averaging its gradient
    return w - 0.5 * r.pmean(jax.grad(loss_fn)(w)), None

  trained = jax.lax.scan(sgd, w, None, length=3)[0]
  gather_grad = jax.grad(lambda v: jnp.sum(a * r.all_gather(v)))(jnp.tanh(w))
  gathered = jax.vmap(r.all_gather)(jnp.stack([a[0], 2 * a[0]]))  # [2, participants, F]
  return dict(loss=loss, grad=grad, mean_grad=r.pmean(grad), tangent=tangent,
              ensemble=r.pmean(ensemble_grads), grad_of_vmap=r.pmean(grad_of_vmap),
              grad_of_scan=r.pmean(grad_of_scan), trained=trained, gather_grad=gather_grad,
              gathered=gathered)


def _expected(x, y, mine, weights, participant):
  """One device: whole-batch values; `mine` selects the participant's rows."""
  whole = lambda w: _mean_loss(w, x, y)
  loss, grad = jax.value_and_grad(whole)(W0)
  w = W0
  for _ in range(3):
    w = w - 0.5 * jax.grad(whole)(w)
  scanned = lambda w: sum(whole(w * s) for s in SCALES)
  return dict(
      loss=loss, mean_grad=grad, tangent=grad @ TANGENT,
      # psum's transpose: this participant's gradient is its own loss's.
      grad=jax.grad(lambda w: _mean_loss(w, x[mine], y[mine]))(W0),
      ensemble=jax.vmap(jax.grad(whole))(_ensemble()),
      grad_of_vmap=jax.vmap(jax.grad(whole))(_ensemble()),
      grad_of_scan=jax.grad(scanned)(W0), trained=w,
      # all_gather's transpose: every participant's weights of my row, summed.
      gather_grad=weights[:, participant].sum(0),
      gathered=np.stack([weights[:, 0], 2 * weights[:, 0]]))


def _gather_weights(participants):
  return np.random.default_rng(1).normal(
      size=(participants, participants, FEATURES)).astype(np.float32)


def _check(got, expected):
  assert set(got) == set(expected)
  for name, value in expected.items():
    np.testing.assert_allclose(np.asarray(got[name]), np.asarray(value), err_msg=name, **TOL)


def test_grad_jvp_vmap_scan_through_reductions_in_a_data_parallel_step(topo):
  x, y = _data(topo)
  weights = _gather_weights(topo.replica_count)
  for route in _routes(topo):
    step = jdist.data_parallel(functools.partial(_quantities, r=_reductions(route)),
                               in_axes=(None, 0, 0, 0))
    mine = reference.local_slices(np.arange(len(x)), topo, PER_REPLICA)
    got = step(W0, reference.local_slices(x, topo, PER_REPLICA),
               reference.local_slices(y, topo, PER_REPLICA), weights[list(topo.replica_indices)])
    for device, replica in enumerate(topo.replica_indices):
      _check(jax.tree.map(lambda v, d=device: v[d], got),
             _expected(x, y, mine[device], weights, replica))


def test_grad_jvp_vmap_scan_through_reductions_in_a_jit_step(topo):
  x, y = _data(topo)
  weights = _gather_weights(topo.process_count)
  rows = np.arange(len(x)).reshape(topo.process_count, -1)[topo.process_index]
  for route in _routes(topo):
    with jax.set_mesh(jdist.mesh()):
      got = jax.jit(functools.partial(_quantities, r=_reductions(route)))(
          W0, jdist.shard_global_batch(x), jdist.shard_global_batch(y),
          weights[topo.process_index])
    _check(got, _expected(x, y, rows, weights, topo.process_index))


class _Net(nnx.Module):
  """Linear -> batch norm -> tanh -> a fixed readout."""

  def __init__(self, norm, rngs):
    self.linear = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.norm = norm

  def __call__(self, x):
    return jnp.tanh(self.norm(self.linear(x))) @ jnp.linspace(-1.0, 1.0, HIDDEN)


def _split(norm):
  return nnx.split(_Net(norm, nnx.Rngs(0)), nnx.Param, ...)


def _norm_quantities(graphdef, params, rest, x, y):
  """Averaged gradients of a batch-normalized net: plain, vmapped, and 2 SGD steps in a scan."""
  def loss_fn(params):
    return jnp.mean((nnx.merge(graphdef, params, rest, copy=True)(x) - y) ** 2)

  grad = jdist.pmean(jax.grad(loss_fn)(params))
  pair = jax.tree.map(lambda p: jnp.stack([p, 1.5 * p]), params)
  pair_grads = jdist.pmean(jax.vmap(jax.grad(loss_fn))(pair))

  def sgd(params, _):
    grads = jdist.pmean(jax.grad(loss_fn)(params))
    return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads), None

  trained = jax.lax.scan(sgd, params, None, length=2)[0]
  return grad, pair_grads, trained


def _norm_expected(x, y):
  graphdef, params, rest = _split(nnx.BatchNorm(HIDDEN, rngs=nnx.Rngs(0)))
  return jax.jit(_one_device_quantities, static_argnums=0)(graphdef, params, rest, x, y)


def _one_device_quantities(graphdef, params, rest, x, y):
  def loss_fn(params):
    return jnp.mean((nnx.merge(graphdef, params, rest, copy=True)(x) - y) ** 2)

  pair = jax.tree.map(lambda p: jnp.stack([p, 1.5 * p]), params)
  trained = params
  for _ in range(2):
    trained = jax.tree.map(lambda p, g: p - 0.5 * g, trained, jax.grad(loss_fn)(trained))
  return jax.grad(loss_fn)(params), jax.vmap(jax.grad(loss_fn))(pair), trained


def _check_states(got, expected):
  got_leaves = dict(jax.tree_util.tree_leaves_with_path(got))
  expected_leaves = dict(jax.tree_util.tree_leaves_with_path(expected))
  assert len(got_leaves) == len(expected_leaves) == 12  # 4 parameters, 3 results
  assert set(map(jax.tree_util.keystr, got_leaves)) == set(
      map(jax.tree_util.keystr, expected_leaves))
  for path, value in expected_leaves.items():
    np.testing.assert_allclose(np.asarray(got_leaves[path]), np.asarray(value),
                               err_msg=jax.tree_util.keystr(path), **TOL)


def test_sync_batchnorm_trains_as_one_device_in_a_data_parallel_step(topo):
  x, y = _data(topo)
  expected = _norm_expected(x, y)
  graphdef, params, rest = _split(jdist.SyncBatchNorm(HIDDEN))
  # On the job's route: SyncBatchNorm's own reductions take it (no ambient
  # state redirects them), and one step keeps to one route.
  step = jdist.data_parallel(lambda *a: _norm_quantities(graphdef, *a),
                             in_axes=(None, None, 0, 0))
  got = step(params, rest, reference.local_slices(x, topo, PER_REPLICA),
             reference.local_slices(y, topo, PER_REPLICA))
  for device in range(topo.local_device_count):
    _check_states(jax.tree.map(lambda v, d=device: v[d], got), expected)


def test_sync_batchnorm_trains_as_one_device_in_a_jit_step(topo):
  x, y = _data(topo)
  expected = _norm_expected(x, y)
  graphdef, params, rest = _split(jdist.SyncBatchNorm(HIDDEN))
  with jax.set_mesh(jdist.mesh()):
    got = jax.jit(_norm_quantities, static_argnums=0)(
        graphdef, params, rest, jdist.shard_global_batch(x), jdist.shard_global_batch(y))
  _check_states(got, expected)


def test_the_backward_pass_exchanges_are_on_the_byte_ledger(topo):
  # jax.grad of a loss through jdist.pmean crosses processes twice: the
  # forward sum and its transpose (the JVP's tangent sum is transposed, not run).
  x, y = _data(topo)
  step = jdist.data_parallel(lambda w, x, y: jax.grad(lambda w: jdist.pmean(
      _mean_loss(w, x, y)))(w), in_axes=(None, 0, 0))
  with collectives.measure() as ledger:
    jax.make_jaxpr(step.pmapped)(W0, reference.local_slices(x, topo, PER_REPLICA),
                                 reference.local_slices(y, topo, PER_REPLICA))
  assert ledger.calls == (0 if topo.process_count == 1 else 2)
