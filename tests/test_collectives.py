"""The collective layer: reductions over every replica, fusion, host exchanges."""

import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import collectives
from jdist import errors
from jdist import fusion
from jdist.collectives import native
from jdist.collectives import ops
from jdist.collectives import routes
from jdist.runtime import job
from tests import jaxpr_graph


def _replica_ids(topo):
  """A per-device array holding each local device's global replica index."""
  return np.array(topo.replica_indices, np.float32)


def test_psum_pmean_all_gather_over_every_replica(topo):
  replicas = topo.replica_count

  @jdist.data_parallel
  def step(ids):
    tree = {"f32": ids * jnp.ones((3, 5)), "i32": ids.astype(jnp.int32) * jnp.ones(4, jnp.int32),
            "f16": (ids * jnp.ones(7)).astype(jnp.float16)}
    return jdist.psum(tree), jdist.pmean(tree), jdist.all_gather(ids)

  summed, mean, gathered = step(_replica_ids(topo))
  total = replicas * (replicas - 1) / 2
  np.testing.assert_array_equal(summed["f32"], np.full((topo.local_device_count, 3, 5), total))
  np.testing.assert_array_equal(summed["i32"], np.full((topo.local_device_count, 4), total))
  assert summed["i32"].dtype == jnp.int32 and summed["f16"].dtype == jnp.float16
  np.testing.assert_allclose(mean["f32"], total / replicas, rtol=1e-6)
  np.testing.assert_allclose(mean["f16"].astype(np.float32), total / replicas, rtol=1e-3)
  for device in range(topo.local_device_count):
    np.testing.assert_array_equal(gathered[device], np.arange(replicas))


def _count_primitives(jaxpr, names):
  """Equations whose primitive's name holds one of `names`, native joins aside."""
  count = 0
  for eqn in jaxpr.eqns:
    if any(n in eqn.primitive.name for n in names) and \
        eqn.params.get("target_name") != native.JOIN_TARGET:
      count += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      count += _count_primitives(sub, names)
  return count


@pytest.mark.parametrize("bucket_bytes, expected_buffers", [(fusion.DEFAULT_BUCKET_BYTES, 1),
                                                            (100 * 40 * 4 // 4, 4)])
def test_hundred_leaves_cross_processes_as_few_buffers(topo, bucket_bytes, expected_buffers):
  tree = {f"leaf{i:03d}": jnp.full((40,), float(i)) for i in range(100)}
  assert len(fusion.plan_buckets(jax.tree.leaves(tree), bucket_bytes)) == expected_buffers
  step = jdist.data_parallel(lambda t: jdist.psum(t, bucket_bytes=bucket_bytes))
  replicated = jdist.replicate(tree)
  jaxpr = jax.make_jaxpr(step.pmapped)(replicated).jaxpr
  cross_process_calls = _count_primitives(jaxpr, ("allreduce_mpi", "pure_callback", "ffi_call",
                                                         "jdist_cross_process"))
  with collectives.measure() as ledger:  # a new function: pmap caches traces
    jax.make_jaxpr(jdist.data_parallel(lambda t: jdist.psum(t, bucket_bytes=bucket_bytes)).pmapped)(replicated)
  if topo.process_count == 1:
    assert cross_process_calls == 0 and ledger.calls == 0
  else:
    # One MPI call per fused buffer, not one per leaf.
    assert cross_process_calls == expected_buffers
    assert ledger.calls == expected_buffers
  out = step(replicated)
  np.testing.assert_array_equal(out["leaf042"][0], np.full((40,), 42.0 * topo.replica_count))


def test_collectives_outside_data_parallel_raise_clear_error():
  for fn in (jdist.psum, jdist.pmean, jdist.all_gather):
    with pytest.raises(errors.CollectiveContextError, match="@jdist.data_parallel"):
      fn({"x": jnp.ones(3)})


def test_broadcast_params_gives_everyone_roots_values(topo):
  root = topo.process_count - 1
  own = {"w": np.full((3, 4), float(topo.process_index), np.float32),
         "b": np.arange(5, dtype=np.int32) * (topo.process_index + 1)}
  got = jdist.broadcast_params(own, root=root)
  np.testing.assert_array_equal(got["w"], np.full((3, 4), float(root)))
  np.testing.assert_array_equal(got["b"], np.arange(5) * (root + 1))
  assert got["b"].dtype == jnp.int32
  with pytest.raises(ValueError, match="root=5 is not a process index"):
    jdist.broadcast_params(own, root=5)


def test_host_allreduce_sums_over_processes(topo):
  out = jdist.host_allreduce({"n": np.array([1.0, topo.process_index])})
  np.testing.assert_array_equal(out["n"], [topo.process_count, sum(range(topo.process_count))])
  mean = jdist.host_allreduce({"n": np.array([2.0])}, mean=True)
  np.testing.assert_array_equal(mean["n"], [2.0])


def test_the_started_route_is_an_object_named_like_the_topology(topo):
  route = routes.named(None)
  assert isinstance(route, routes.Route)
  assert route.name == collectives.route() == topo.route
  assert routes.named(route.name) is route
  if topo.process_count > 1 and native.running():
    assert topo.route == "native"
  # Jit steps take the same route in every topology, MxN included.
  assert topo.jit_route == topo.route


def test_init_route_argument_is_checked():
  # Later calls must agree with the first; a bad name is named with the allowed ones.
  topo = jdist.init()
  assert jdist.init(route=topo.route) is topo
  other = "callback" if topo.route != "callback" else "native"
  with pytest.raises(ValueError, match=re.escape(f"init(route='{other}') after jdist was initialized")):
    jdist.init(route=other)
  with pytest.raises(ValueError, match="give a route name, one of local, mpi4jax, native"):
    jdist.init(route=3)
  with pytest.raises(ValueError, match="route='ring' is not a jdist route"):
    collectives.on_route("ring")


def test_route_selection():
  def fake(processes, devices, backend="mpi"):
    return jdist.Topology(0, processes, devices, backend=backend)

  assert isinstance(routes.select(fake(1, 4, "none")), routes.LocalRoute)
  assert routes.select(fake(2, 2, "jax"), "local").name == "local"
  with pytest.raises(ValueError, match="route='callback': this job runs backend 'jax'"):
    routes.select(fake(2, 2, "jax"), "callback")
  assert routes.select(fake(2, 1)).name == ("native" if native.running() else "mpi4jax")
  assert routes.select(fake(2, 1), "mpi4jax").name == "mpi4jax"
  assert routes.select(fake(2, 1), "callback").name == "callback"
  assert routes.select(fake(2, 2), "callback").name == "callback"
  with pytest.raises(ValueError, match="route='mpi4jax' needs one device per process"):
    routes.select(fake(2, 2), "mpi4jax")
  with pytest.raises(ValueError, match="JDIST_ROUTE='ring' is not a jdist route: choose one "
                                       "of local, mpi4jax, native, callback"):
    routes.select(fake(2, 2), "ring", source="JDIST_ROUTE")
  with pytest.raises(ValueError, match="route='native': this job runs one process"):
    routes.select(fake(1, 4, "none"), "native")
  with pytest.raises(ValueError, match="route='local': XLA's collectives do not cross"):
    routes.select(fake(2, 2), "local")
  if not native.running():
    assert routes.select(fake(2, 2)).name == "callback"
    with pytest.raises(ValueError, match="route='native', but the native exchange"):
      routes.select(fake(2, 2), "native")
  else:
    assert routes.select(fake(2, 2)).name == "native"
    assert routes.select(fake(2, 2), "native").name == "native"


def test_structure_mismatch_message_names_first_leaf():
  a = job._signature({"w": jnp.ones((2, 3)), "b": jnp.ones(3)})
  b = job._signature({"w": jnp.ones((2, 4)), "b": jnp.ones(3)})
  message = job._describe_mismatch([a, b], "jdist.psum")
  assert "['w']" in message and "(2, 3)" in message and "(2, 4)" in message and "rank 1" in message


def test_plan_buckets_cuts_last_leaf_first_with_a_small_first_bucket():
  leaves = [jnp.ones(10), jnp.ones(10, jnp.int32), jnp.ones(30), jnp.ones(5), jnp.ones(100)]
  buckets = fusion.plan_buckets(leaves, bucket_bytes=160, first_bucket_bytes=100)
  covered = sorted(i for b in buckets for i in b.leaf_ids)
  assert covered == list(range(5))
  for bucket in buckets:
    assert len({np.dtype(leaves[i].dtype) for i in bucket.leaf_ids}) == 1
  floats = [b.leaf_ids for b in buckets if b.dtype == np.float32]
  # The last leaf (400 bytes) fills the first bucket alone; then 5 + 30 + 10
  # floats (180 bytes) close the next at its 160-byte cap.
  assert floats == [(4,), (3, 2, 0)]
  assert [b.leaf_ids for b in buckets if b.dtype == np.int32] == [(1,)]
  # A bucket closes at its cap: it exceeds it by its last leaf at most.
  for bucket in buckets:
    assert bucket.nbytes - bucket.sizes[-1] * np.dtype(bucket.dtype).itemsize < 160
  for bad in ({"bucket_bytes": 0}, {"first_bucket_bytes": -1}):
    with pytest.raises(ValueError, match=next(iter(bad))):
      fusion.plan_buckets(leaves, **bad)


def test_plan_buckets_sends_a_leaf_that_fills_a_bucket_alone_after_the_leaves_before_it():
  # Reversed: leaf 3 (40 bytes) is collected, leaf 2 (400 bytes) reaches the
  # first cap alone, so leaf 3 leaves first and leaf 2 goes uncopied; leaf 1
  # reaches the 160-byte cap alone too; leaf 0 stays small.
  leaves = [jnp.ones(5), jnp.ones(40), jnp.ones(100), jnp.ones(10)]
  buckets = fusion.plan_buckets(leaves, bucket_bytes=160, first_bucket_bytes=100)
  assert [b.leaf_ids for b in buckets] == [(3,), (2,), (1,), (0,)]
  big = buckets[1]
  packed = jax.make_jaxpr(lambda *ls: fusion.pack(ls, big))(*leaves)
  assert "concatenate" not in str(packed)


def test_pack_unpack_and_ravel_round_trip():
  tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.arange(4, dtype=jnp.bfloat16)}
  spec = fusion.flat_spec(tree)
  flat = fusion.ravel(tree)
  assert flat.shape == (10,) and spec.size == 10
  back = fusion.unravel(flat, spec)
  assert back["b"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(back["a"], tree["a"])
  leaves = jax.tree.leaves(tree)
  bucket = next(b for b in fusion.plan_buckets(leaves) if 0 in b.leaf_ids)
  np.testing.assert_array_equal(fusion.unpack(fusion.pack(leaves, bucket), bucket,
                                              [l.shape for l in leaves])[0], tree["a"])


def test_host_exchanges_of_a_step_are_chained_in_trace_order():
  # Independent exchanges must run in one order on every device of every
  # process (else a device blocked in MPI and another in a local collective
  # can deadlock), so each exchange's input waits for the previous one's
  # output. Traced only: nothing runs, so any topology can check it.
  def exchange(x):  # shaped like a route's gather_all on the callback route
    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    ready = routes.callback.after_previous_exchange(x)
    return routes.callback.exchange_done(
        routes.callback.host_callback(lambda v, d: v, collectives.DATA_AXIS, spec, ready))

  def step(a, b, c):
    return exchange(a), exchange(b), exchange(c)

  ones = jnp.ones((1, 3), jnp.float32)
  traced = jax.make_jaxpr(jax.pmap(step, axis_name=collectives.DATA_AXIS))(ones, ones, ones)

  inner = jaxpr_graph.find_body(traced, "pure_callback")  # pmap nests it in jit / shard_map
  callbacks = jaxpr_graph.equations(inner, "pure_callback")
  assert len(callbacks) == 3
  assert jaxpr_graph.depends_on(inner, callbacks[1], callbacks[0])
  assert jaxpr_graph.depends_on(inner, callbacks[2], callbacks[1])
  assert not jaxpr_graph.depends_on(inner, callbacks[0], callbacks[1])


def test_means_of_floats_near_the_largest_float32_are_those_of_their_route(topo):
  # Across processes 32-bit floats are scaled before the sum (fused into the
  # bucket packing): every replica's 3e38 averages to 3e38, where a sum first
  # would overflow to inf. Within one process the mean is lax.pmean's, sum
  # then divide. 16-bit floats are divided after the sum everywhere (their
  # small values would underflow first).
  tx = jdist.allreduce()

  @jdist.data_parallel
  def step(ids):
    tree = {"f32": jnp.full((5,), 3e38, jnp.float32) + 0 * ids,
            "f16": (ids * jnp.ones(3)).astype(jnp.float16)}
    return (tx.update(tree, tx.init(tree))[0], jdist.pmean(tree),
            jax.lax.pmean(tree, collectives.DATA_AXIS))

  averaged, pmeaned, xla_mean = step(_replica_ids(topo))
  mean_id = (topo.replica_count - 1) / 2
  expected_f32 = (np.asarray(xla_mean["f32"]) if collectives.route() == "local"
                  else np.full((topo.local_device_count, 5), 3e38, np.float32))
  for result in (averaged, pmeaned):
    np.testing.assert_allclose(result["f32"], expected_f32, rtol=1e-6)
    np.testing.assert_allclose(result["f16"].astype(np.float32), mean_id, rtol=1e-3)


def _traced_mean(route):
  """A step taking `jdist.allreduce()`'s mean, traced (not run) on `route`."""
  # jdist.allreduce()'s reduction, on a route given explicitly.
  step = jax.pmap(collectives.on_route(route).reduce_payload, axis_name=collectives.DATA_AXIS)
  tree = {"w": jnp.ones((jax.local_device_count(), 8), jnp.float32)}
  return jax.make_jaxpr(step)(tree)


@pytest.mark.parametrize("route_class, exchange", [(routes.LocalRoute, "psum"),
                                                   (routes.CallbackRoute, "jdist_cross_process")])
def test_means_scale_before_the_sum_only_where_it_packs_buckets(topo, route_class, exchange):
  # Within one process (the local route) the sum is XLA's all-reduce of each
  # leaf: a multiply before it would be a pass of its own over the gradients
  # (an MLP step 1.13-1.29x the hand-written one's time), after it it fuses
  # into the update, as lax.pmean's. Across processes the multiply fuses into
  # the bucket packing, before the exchange.
  route = (route_class(topo) if route_class is routes.LocalRoute
           else route_class(topo, world=None))
  body = jaxpr_graph.find_body(_traced_mean(route), exchange)
  (summed,) = jaxpr_graph.equations(body, exchange)
  multiplies = jaxpr_graph.equations(body, "mul")
  assert multiplies
  scaled_first = [m for m in multiplies if jaxpr_graph.depends_on(body, summed, m)]
  scaled_after = [m for m in multiplies if jaxpr_graph.depends_on(body, m, summed)]
  if route_class is routes.LocalRoute:
    assert scaled_after and not scaled_first
  else:
    assert scaled_first and not scaled_after
