"""Single-device references that distributed runs are compared against.

Each process builds the *global* batch from a seed, trains the reference on
all of it on one device, and feeds its own replicas' slices to jdist: N
replicas on batches of B must train like one device on the N*B batch.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist


class TinyMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(32)(x))
    return nn.Dense(10)(x)


class TinyCNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(8, (3, 3))(x))
    x = nn.max_pool(x, (2, 2), (2, 2))
    x = nn.relu(nn.Conv(16, (3, 3))(x))
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(10)(x)


def global_batch(replicas, per_replica, seed=0, shape=(8, 8, 1)):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(replicas * per_replica,) + shape).astype(np.float32)
  y = rng.integers(0, 10, size=(replicas * per_replica,)).astype(np.int32)
  return x, y


def local_slices(array, topo, per_replica):
  """This process's replicas' rows, shaped [local_devices, per_replica, ...]."""
  rows = [array[r * per_replica:(r + 1) * per_replica] for r in topo.replica_indices]
  return np.stack(rows)


def loss_fn(model, params, x, y):
  logits = model.apply(params, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step_fn(model, tx):
  """The per-replica step: gradients of the local batch, then `tx`."""
  def step(params, opt_state, x, y):
    grads = jax.grad(lambda p: loss_fn(model, p, x, y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def train_reference(model, params, tx, batches, steps):
  """One device, the whole global batch each step."""
  opt_state = tx.init(params)
  step = jax.jit(train_step_fn(model, tx))
  for i in range(steps):
    x, y = batches[i % len(batches)]
    params, opt_state = step(params, opt_state, x, y)
  return params


def train_jdist(model, params, tx, batches, steps, topo, per_replica):
  """Every replica on its own slice of the same global batches."""
  replicated = jdist.replicate(params)
  opt_state = jdist.data_parallel(tx.init)(replicated)
  step = jdist.data_parallel(train_step_fn(model, tx))
  for i in range(steps):
    x, y = batches[i % len(batches)]
    replicated, opt_state = step(replicated, opt_state, local_slices(x, topo, per_replica),
                                 local_slices(y, topo, per_replica))
  return replicated, opt_state


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


def assert_reductions_combine_one_value_per_process(mesh, spec, size, topo):
  """In a jit step over `mesh`, psum/pmean/all_gather of a value laid out as
  `spec` (every process holds its rank + 1) combine one value per process."""
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top

  @jax.jit
  def reduce(x):
    return jdist.psum(x), jdist.pmean(x), jdist.all_gather(x)

  with jax.set_mesh(mesh):
    value = jax.device_put(jnp.full((size,), float(topo.process_index + 1)),
                           NamedSharding(mesh, spec))
    total, mean, gathered = reduce(value)
  processes = np.arange(1, topo.process_count + 1, dtype=np.float32)
  np.testing.assert_allclose(total, np.full(size, processes.sum()))
  np.testing.assert_allclose(mean, np.full(size, processes.mean()))
  np.testing.assert_allclose(gathered, np.repeat(processes[:, None], size, axis=1))



def checkpoint_round_trip(topo, tree, step=4):
  """`tree` saved by `jdist.CheckpointManager` in a fresh directory and restored."""
  import shutil  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  from jdist.runtime import host  # pylint: disable=g-import-not-at-top
  directory = tempfile.mkdtemp(prefix="jdist_test_ckpt_") if topo.is_primary else None
  directory = host.allgather_object(directory)[0]
  try:
    manager = jdist.CheckpointManager(directory)
    manager.save(step, tree)
    restored, _ = manager.restore(jax.eval_shape(lambda t: t, tree))
  finally:
    host.barrier()
    if topo.is_primary:
      shutil.rmtree(directory, ignore_errors=True)
  return restored


def every_replica_grads(topo, shapes, seed):
  """A gradient tree per global replica, [replicas, ...] per leaf, with entries
  spread over six orders of magnitude (as compressors meet them)."""
  rng = np.random.default_rng(seed)
  return {name: (rng.normal(size=(topo.replica_count,) + shape)
                 * rng.choice([1e-3, 1.0, 30.0], size=(topo.replica_count, 1) + shape[1:])
                 ).astype(np.float32) for name, shape in shapes.items()}


def local_rows(every, topo):
  """This process's replicas' rows of a tree of [replicas, ...] leaves."""
  return jax.tree.map(lambda x: x[list(topo.replica_indices)], every)


def wire_bytes_of(tx, local):
  """Bytes one update of `tx` sends across processes (`jdist.wire_bytes`), from init."""
  @jdist.data_parallel
  def step(g):
    out, state = tx.update(g, tx.init(g))
    return out, jdist.wire_bytes(state)
  return float(np.asarray(step(local)[1])[0])
