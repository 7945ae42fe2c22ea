"""Exchanges in any order: control flow, devices that reach them in different orders.

On the native route (2 x 2) no exchange waits for another, so none of these
can deadlock; on the other routes they check the same results. Buffers of
256K floats: the callback route deadlocked from about 64K floats.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jdist
from jdist.collectives.routes import base
from jdist import collectives
from jdist import consistency
from jdist.runtime import host
from jdist.transforms.finite import skip_nonfinite
from tests import reference

N = 1 << 18
REPEATS = 3


def _per_replica(topo, fn):
  """[local devices, N] float32: row d holds fn(replica index of device d)."""
  return jnp.stack([jnp.full((N,), fn(r), jnp.float32) for r in topo.replica_indices])


def test_exchanges_in_both_branches_of_a_cond_beside_independent_ones(topo):
  replicas = topo.replica_count
  total = sum(range(replicas))

  @jdist.data_parallel
  def step(a, b, take_first):
    # Both branches exchange; the gather and the last psum do not depend on
    # the cond, so XLA may run them before, during or after it.
    chosen = lax.cond(take_first[0] > 0, lambda: jdist.psum(a), lambda: 2.0 * jdist.psum(b))
    gathered = jdist.all_gather(a[:8])
    return chosen, gathered, jdist.psum(b + 1.0)

  a = _per_replica(topo, float)
  b = _per_replica(topo, lambda r: 10.0 * r)
  for i in range(2 * REPEATS):
    take_first = i % 2 == 0
    flag = jnp.full((topo.local_device_count, 1), int(take_first), jnp.int32)
    chosen, gathered, last = step(a, b, flag)
    expected = total if take_first else 2.0 * 10.0 * total
    np.testing.assert_allclose(np.asarray(chosen), expected)
    np.testing.assert_allclose(np.asarray(gathered)[0, :, 0], np.arange(replicas))
    np.testing.assert_allclose(np.asarray(last), 10.0 * total + replicas)


def test_exchanges_in_every_branch_of_a_switch(topo):
  replicas = topo.replica_count
  total = sum(range(replicas))

  @jdist.data_parallel
  def step(a, index):
    branches = [
        lambda: jdist.psum(a),
        lambda: jdist.psum(a.astype(jnp.bfloat16)).astype(jnp.float32),
        # Any replica count: gather a slice, then fill N from it.
        lambda: jnp.resize(jdist.all_gather(a[:N // replicas]).reshape(-1), (N,)) * 0.0 + 7.0,
    ]
    return lax.switch(index[0], branches), jdist.psum(a * 2.0)

  a = _per_replica(topo, float)
  for i in range(3 * REPEATS):
    which = i % 3
    out, doubled = step(a, jnp.full((topo.local_device_count, 1), which, jnp.int32))
    expected = [total, total, 7.0][which]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(doubled), 2.0 * total)


def test_devices_that_reach_exchanges_in_opposite_orders(topo):
  # Device 0 computes x's input slowly and device 1 y's: with XLA's
  # concurrent executor they reach the two exchanges in opposite orders.
  replicas = topo.replica_count
  total = sum(range(replicas))

  def slow(v):
    return lax.fori_loop(0, 20, lambda _, u: jnp.sin(u) * 0.0 + u, v)

  @jdist.data_parallel
  def step(a):
    first = lax.axis_index(collectives.DATA_AXIS) == 0
    x = lax.cond(first, slow, lambda v: v, a)
    y = lax.cond(first, lambda v: v, slow, a * 3.0)
    return jdist.psum(x), jdist.all_gather(y[:4]), jdist.psum(y.astype(jnp.float16))

  a = _per_replica(topo, float)
  for _ in range(REPEATS):
    x, gathered, y16 = step(a)
    np.testing.assert_allclose(np.asarray(x), total)
    np.testing.assert_allclose(np.asarray(gathered)[0, :, 0], 3.0 * np.arange(replicas))
    np.testing.assert_allclose(np.asarray(y16).astype(np.float32), 3.0 * total, rtol=1e-3)


def test_topk_gather_beside_the_nonfinite_flag_allreduce(topo):
  # The combination that deadlocked the callback route in 2 x 2 before its
  # exchanges were chained: a top-K all-gather beside skip_nonfinite's flag
  # all-reduce, under MultiSteps' lax.cond.
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(1), x0)
  batches = [reference.global_batch(topo.replica_count, 4, seed=s) for s in range(4)]
  tx = optax.MultiSteps(skip_nonfinite(jdist.dist_opt(optax.sgd(0.05), sparsify="topk:0.1")),
                        every_k_schedule=2)
  replicated, _ = reference.train_jdist(model, params, tx, batches, 4, topo, 4)
  # Parameters stay identical (residuals and accumulators are per replica).
  assert consistency.check_replicas(replicated) == []


def test_ordinals_number_a_steps_exchanges_from_zero_each_trace():
  seen = []
  for _ in range(2):
    with base.step_scope("s"):
      seen.append([base.next_ordinal() for _ in range(3)])
  assert seen == [[0, 1, 2], [0, 1, 2]]
  assert base.next_ordinal() >= 1 << 20  # outside a step: far from a step's


def test_native_route_is_taken_across_processes(topo):
  # Where the library is built (scripts/install.sh builds it), every
  # multi-process CPU job takes the native route: its step holds custom
  # calls, not host callbacks or blocking mpi4jax calls.
  from jdist.collectives import native  # pylint: disable=import-outside-toplevel
  if topo.process_count == 1:
    assert collectives.route() == "local"
    return
  import os  # pylint: disable=import-outside-toplevel
  if not os.path.exists(native.CPU_LIBRARY):
    fallback = "mpi4jax" if topo.local_device_count == 1 else "callback"
    assert collectives.route() == fallback and topo.route == fallback
    return
  assert native.running() and collectives.route() == "native" and topo.route == "native"
  assert "route native" in str(topo)
  step = jdist.data_parallel(lambda x: jdist.psum(x))
  text = str(jax.make_jaxpr(step.pmapped)(jnp.ones((topo.local_device_count, 4))))
  assert "route=NativeRoute" in text and "pure_callback" not in text


def test_reduced_buckets_are_read_through_one_join(topo):
  # Several buckets on the native route: every reduced bucket is read through
  # one aliasing custom call, so no update runs between two exchanges (which
  # would make the rest of the backward pass wait for the first one).
  tree = {f"w{i}": jnp.full((64,), float(i)) for i in range(4)}
  step = jdist.data_parallel(lambda t: jdist.psum(t, bucket_bytes=256))
  out = step(jdist.replicate(tree))
  for i in range(4):
    np.testing.assert_allclose(out[f"w{i}"], float(i) * topo.replica_count)
  hlo = step.pmapped.lower(jdist.replicate(tree)).as_text()
  if collectives.route() == "native":
    assert hlo.count("jdist_exchange") == 4 and hlo.count("jdist_join") == 1
  else:
    assert "jdist_join" not in hlo



def _program(compiled) -> str:
  """A compiled step's HLO without source locations.

  Both the instructions' metadata and the module's tables of source files,
  functions and stack frames go: the tables' numbering follows the order in
  which the process first met each frame, which earlier traces decide.
  """
  text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
  return re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(\d+ .*\n)*", "", text,
                flags=re.MULTILINE)


def _rank_dependent(x, key):
  """Reductions beside values that depend on the replica: a gather's transpose, a replica key."""
  gather_grad = jax.grad(lambda v: jnp.sum(jnp.arange(3.0) * jdist.all_gather(v)))(jnp.tanh(x[:3]))
  noise = jax.random.normal(jdist.replica_key(key), (3,))
  return jdist.pmean(gather_grad + noise), jdist.psum(jnp.sum(x))


def test_every_process_compiles_the_same_program(topo):
  # A replica's index folded into the program as a literal let XLA simplify
  # rank 0's program differently (0 * k + i -> i), and its schedule ran two
  # independent exchanges in the other order: each rank then waited in the
  # exchange the other had not reached (the autodiff tests' jit step, 2 x 2,
  # native route). The index is a run-time value: one program everywhere.
  key = jax.random.key(0)
  x = np.arange(8.0 * topo.replica_count, dtype=np.float32)
  with jax.set_mesh(jdist.mesh()):
    jit_step = jax.jit(_rank_dependent).lower(jdist.shard_global_batch(x), key).compile()
  per_device = x.reshape(topo.replica_count, -1)[:topo.local_device_count]
  step = jdist.data_parallel(_rank_dependent, in_axes=(0, None))
  data_parallel_step = step.compiled.lower(per_device, key).compile()
  programs = (_program(jit_step), _program(data_parallel_step))
  everyone = host.allgather_object(programs)
  assert len(everyone) == topo.process_count
  for style, program in zip(("jit", "data_parallel"), programs):
    assert all(other[style == "data_parallel"] == program for other in everyone), (
        f"the processes compiled different {style} programs")
