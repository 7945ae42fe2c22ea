"""Silent divergence made loud: structure checks across processes, replica checks.

Every test runs the same collectives on every rank (under mpirun the ranks
run this file in lockstep); where ranks are meant to differ, only the data
differs, so a failure is an error on every rank, never a hang.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jdist
from jdist import consistency
from jdist import errors
from jdist.runtime import job


def _tree(topo, *, extra=False, wide=False):
  """Rank 1 may hold an extra leaf (`extra`) or a wider 'w' (`wide`)."""
  odd = topo.process_index == 1
  tree = {"b": jnp.ones((2,), jnp.float32), "w": jnp.zeros((3 if wide and odd else 2, 4))}
  if extra and odd:
    tree["z_extra"] = jnp.ones((5,), jnp.float32)
  return tree


# --- structure checks ----------------------------------------------------------

def test_mismatch_message_names_first_differing_leaf_and_both_sides():
  ours = [("['b']", (2,), "float32"), ("['w']", (2, 4), "float32")]
  theirs = [("['b']", (2,), "float32"), ("['w']", (3, 4), "float32")]
  text = job._describe_mismatch([ours, theirs], "jdist.psum")  # pylint: disable=protected-access
  assert text.startswith("jdist.psum: processes hold different pytrees")
  assert "leaf #1: rank 0 has ['w'] shape=(2, 4) dtype=float32, rank 1 has ['w'] shape=(3, 4)" in text
  extra = ours + [("['z_extra']", (5,), "float32")]
  text = job._describe_mismatch([ours, ours, extra], "x")  # pylint: disable=protected-access
  assert "leaf #2: rank 0 has no leaf, rank 2 has ['z_extra'] shape=(5,)" in text


def test_structure_check_is_a_noop_in_one_process_and_passes_equal_trees(topo):
  # Equal trees pass in every topology; in one process any tree passes.
  job.check_structure(_tree(topo), "test")
  if topo.process_count == 1:
    job.check_structure(_tree(topo, extra=True, wide=True), "test")
    job.check_structure({"anything": np.zeros(7)}, "test")


@pytest.mark.parametrize("kind", ["extra_leaf", "shape"])
def test_broadcast_params_of_different_trees_fails_on_every_rank(topo, kind):
  tree = _tree(topo, extra=kind == "extra_leaf", wide=kind == "shape")
  if topo.process_count == 1:
    out = jdist.broadcast_params(tree)  # nothing to compare against
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    return
  first = r"\['z_extra'\]" if kind == "extra_leaf" else r"\['w'\] shape=\(2, 4\).*\['w'\] shape=\(3, 4\)"
  with pytest.raises(errors.StructureMismatchError, match=first):
    jdist.broadcast_params(tree)
  # Nothing is left half-exchanged: the next collective works.
  np.testing.assert_array_equal(jdist.broadcast_params(_tree(topo))["b"], np.ones(2))


@pytest.mark.parametrize("kind", ["extra_leaf", "shape"])
def test_psum_of_different_trees_fails_on_every_rank(topo, kind):
  tree = _tree(topo, extra=kind == "extra_leaf", wide=kind == "shape")
  replicated = jdist.replicate(tree)
  step = jdist.data_parallel(jdist.psum)
  if topo.process_count == 1:
    summed = step(replicated)
    np.testing.assert_allclose(jdist.unreplicate(summed)["b"], topo.replica_count * np.ones(2))
    return
  first = r"\['z_extra'\]" if kind == "extra_leaf" else r"\['w'\] shape=\(2, 4\).*\['w'\] shape=\(3, 4\)"
  with pytest.raises(errors.StructureMismatchError, match=first):
    step(replicated)  # raised while tracing, before any step is dispatched
  summed = jdist.data_parallel(jdist.psum)(jdist.replicate(_tree(topo)))
  np.testing.assert_allclose(jdist.unreplicate(summed)["b"], topo.replica_count * np.ones(2))


# --- replica checks ------------------------------------------------------------

def _params():
  key = jax.random.key(0)
  return {"dense": {"kernel": jax.random.normal(key, (4, 3)), "bias": jnp.zeros((3,))},
          "scale": jnp.ones((2,), jnp.bfloat16), "count": jnp.zeros((), jnp.int32)}


def _perturb_replica(replicated, topo, replica, path):
  """Nudges one entry of the leaf at `path` on global replica `replica` by one ulp."""
  @jdist.data_parallel
  def nudge(tree):
    me = topo.process_index * topo.local_device_count + lax.axis_index(jdist.DATA_AXIS)

    def maybe(leaf_path, leaf):
      if jax.tree_util.keystr(leaf_path) != path:
        return leaf
      flat = leaf.reshape(-1)
      bumped = flat.at[0].set(jnp.nextafter(flat[0], jnp.inf))
      return jnp.where(me == replica, bumped, flat).reshape(leaf.shape)
    return jax.tree_util.tree_map_with_path(maybe, tree)
  return nudge(replicated)


def test_identical_replicas_have_no_mismatch(topo):
  replicated = jdist.replicate(_params())
  assert consistency.check_replicas(replicated) == []
  assert consistency.check_replicas(replicated, raise_on_mismatch=True) == []


def test_a_perturbed_replica_is_found_and_named_on_every_rank(topo):
  last = topo.replica_count - 1
  replicated = _perturb_replica(jdist.replicate(_params()), topo, last, "['dense']['kernel']")
  mismatches = consistency.check_replicas(replicated)
  assert [(m.path, m.replicas) for m in mismatches] == [("['dense']['kernel']", (last,))]
  assert len(mismatches[0].sums) == topo.replica_count
  with pytest.raises(consistency.ReplicaMismatchError) as raised:
    consistency.check_replicas(replicated, raise_on_mismatch=True)
  assert isinstance(raised.value, errors.JdistError)
  assert "1 of 4 leaves differ" in str(raised.value)
  assert f"['dense']['kernel']: differs from replica 0" in str(raised.value)
  assert f"on replica {last} sum" in str(raised.value)


def test_every_differing_replica_and_leaf_is_listed(topo):
  replicated = jdist.replicate(_params())
  # Replica 0 itself differs: then every other replica differs from it.
  replicated = _perturb_replica(replicated, topo, 0, "['scale']")
  replicated = _perturb_replica(replicated, topo, topo.replica_count - 1, "['dense']['bias']")
  mismatches = consistency.check_replicas(replicated)
  others = tuple(range(1, topo.replica_count))
  assert [(m.path, m.replicas) for m in mismatches] == [
      ("['dense']['bias']", (topo.replica_count - 1,)), ("['scale']", others)]


def test_an_unreplicated_tree_is_rejected_on_every_rank(topo):
  with pytest.raises(errors.ShapeError, match=r"leaf \['count'\] has a scalar.*jdist.replicate"):
    consistency.check_replicas(_params())
