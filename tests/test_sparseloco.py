"""SparseLoCo's payload (jdist.compression.sparseloco) and `jdist.diloco(payload="sparse")`.

The codec is checked against a NumPy reference written here (top entries of
each chunk by argsort, two magnitudes per chunk); DiLoCo with it against
tests/test_diloco.py's K-worker reference with that round trip, in the
in-step and (2x1, 2x2: native route) background sync; with every entry sent
and values of two magnitudes (no quantization error) it is dense DiLoCo.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist import fusion
from jdist.app import config as config_lib
from jdist.compression import pack4
from jdist.compression import sparseloco
from jdist.transforms import diloco as diloco_lib
from tests import reference
from tests.test_diloco import PER_REPLICA, _setup, check_encoded_run, reference_diloco

# jdist.init() before any JAX computation, also when this file runs alone under mpirun.
pytestmark = pytest.mark.usefixtures("topo")


def numpy_round_trip(x, ratio):
  """What the replicas decode of flat float32 x: per chunk, the top ceil(ratio * chunk)
  magnitudes, each its sign times the mean magnitude of its side of the chunk's mean."""
  chunk = min(sparseloco.CHUNK, x.size)
  kept = max(1, math.ceil(ratio * chunk))
  rows = np.pad(x, (0, -x.size % chunk)).reshape(-1, chunk)
  decoded = np.zeros_like(rows)
  for row, out in zip(rows, decoded):
    top = np.argsort(-np.abs(row), kind="stable")[:kept]
    magnitude = np.abs(row[top])
    high = magnitude > magnitude.mean(dtype=np.float32)
    for side in (high, ~high):
      if side.any():
        out[top[side]] = np.sign(row[top[side]]) * magnitude[side].mean(dtype=np.float32)
  return decoded.reshape(-1)[:x.size]


@pytest.mark.parametrize("size", [1, 3, 4, 5, 17])
def test_two_bit_fields_round_trip(size):
  codes = np.random.default_rng(size).integers(0, 4, size=size).astype(np.uint8)
  packed = pack4.pack_fields(jnp.asarray(codes), 2)
  assert packed.shape == (pack4.packed_size(size, 2),) == (-(-size // 4),)
  np.testing.assert_array_equal(np.asarray(pack4.unpack_fields(packed, size, 2)), codes)
  rows = jnp.stack([packed, packed[::-1]])  # gathered rows unpack at once
  assert pack4.unpack_fields(rows, size, 2).shape == (2, size)
  with pytest.raises(ValueError, match="bits=3"):
    pack4.pack_fields(jnp.asarray(codes), 3)


def test_encode_matches_numpy_and_feedback_conserves_the_sum():
  x = jax.random.normal(jax.random.key(0), (9000,), jnp.float32)  # 3 chunks, the last short
  spec = fusion.flat_spec([x])
  payload, sent = sparseloco.encode(x, spec, 0.02)
  np.testing.assert_allclose(np.asarray(sent), numpy_round_trip(np.asarray(x), 0.02),
                             rtol=1e-6, atol=1e-7)
  assert int(np.count_nonzero(np.asarray(sent))) == 3 * 82
  # What was not sent stays whole in the residual: sent + residual == x, exactly.
  residual = x - sent
  np.testing.assert_array_equal(np.asarray(sent + residual), np.asarray(x))
  untouched = np.asarray(sent) == 0
  np.testing.assert_array_equal(np.asarray(residual)[untouched], np.asarray(x)[untouched])
  # The bytes: uint16 offsets, 2-bit codes, two float32 scales per chunk.
  assert payload.to_wire().shape == (sparseloco.wire_size(payload.ctx),)
  assert sparseloco.wire_size(payload.ctx) == 2 * 246 + 62 + 8 * 3


def test_values_of_two_magnitudes_decode_exactly():
  x = jnp.asarray([1.0, -2.0, 0.5, 2.0, -1.0, 0.25], jnp.float32)
  _, sent = sparseloco.encode(x, fusion.flat_spec([x]), 4 / 6)
  np.testing.assert_array_equal(np.asarray(sent), [1.0, -2.0, 0.0, 2.0, -1.0, 0.0])


SPARSE_CASES = {
    "in_step": dict(sync_every=3),
    "delayed": dict(sync_every=4, fragments=2, delay=2, mix=0.5),  # native: in background
}


@pytest.mark.parametrize("case", sorted(SPARSE_CASES))
def test_sparse_payload_matches_emulated_workers(topo, case):
  model, params, batches = _setup(topo, seed=7)
  inner, outer = optax.sgd(0.1, momentum=0.9), optax.sgd(0.7, momentum=0.9, nesterov=True)
  settings, steps = SPARSE_CASES[case], 8  # each fragment exchanges twice
  tx = jdist.diloco(inner, outer=outer, payload="sparse:0.1", **settings)
  replicated, state = reference.train_jdist(model, params, tx, batches, steps, topo,
                                            PER_REPLICA)
  workers, outer_params, residuals = reference_diloco(
      model, params, inner, outer, batches, steps, topo.replica_count,
      round_trip=lambda x: numpy_round_trip(x, 0.1), **settings)
  check_encoded_run(topo, replicated, state, workers, outer_params, residuals)


def _linear_run(topo, payload, steps=4):
  """DiLoCo (H = 2, outer SGD 1) on loss sum(c * w): each replica's gradient is its own
  constant c, in {+-1, +-2}, so every pseudo-gradient is 2 lr c, of two magnitudes."""
  replicas = topo.replica_count
  signs = np.where(np.arange(replicas * 8).reshape(replicas, 8) % 3 == 0, -1.0, 1.0)
  c = (signs * (1 + np.arange(replicas * 8).reshape(replicas, 8) % 2)).astype(np.float32)
  tx = jdist.diloco(optax.sgd(0.5), sync_every=2, outer=optax.sgd(1.0), payload=payload)
  params = jdist.replicate({"w": jnp.zeros((8,), jnp.float32)})
  state = jdist.data_parallel(tx.init)(params)

  def step(params, state, c):
    grads = jax.grad(lambda p: jnp.sum(c * p["w"]))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jdist.data_parallel(step)
  mine = np.stack([c[r] for r in topo.replica_indices])
  for _ in range(steps):
    params, state = step(params, state, mine)
  return params, state


def test_every_entry_sent_without_quantization_error_is_dense_diloco(topo):
  dense, _ = _linear_run(topo, None)
  sparse, state = _linear_run(topo, "sparse:1")
  np.testing.assert_array_equal(np.asarray(sparse["w"]), np.asarray(dense["w"]))
  assert not np.asarray(state.residual["w"]).any()


def test_a_sync_step_counts_the_payload_bytes(topo):
  model, params, batches = _setup(topo)
  size = sum(leaf.size for leaf in jax.tree.leaves(params))
  ctx = sparseloco.context(fusion.flat_spec(jax.tree.leaves(params)), 0.02)
  for delay in (0, 1):
    tx = jdist.diloco(optax.sgd(0.1), sync_every=2, delay=delay, payload="sparse")
    replicated = jdist.replicate(params)
    state = jdist.data_parallel(tx.init)(replicated)
    step = jdist.data_parallel(reference.train_step_fn(model, tx))
    sent = []
    for i in range(2):
      x, y = (reference.local_slices(a, topo, PER_REPLICA) for a in batches[i])
      replicated, state = step(replicated, state, x, y)
      sent.append(float(jdist.wire_bytes(jdist.unreplicate(state))))
    assert sent[0] == 0
    processes, devices = topo.process_count, topo.local_device_count
    if processes == 1:
      assert sent[1] == 0
      continue
    gathered = (processes - 1) * devices * sparseloco.wire_size(ctx)
    if delay and jdist.collectives.route() == "native":  # a sum of zero-padded rows
      rows = topo.replica_count * 4 * -(-sparseloco.wire_size(ctx) // 4)
      gathered = 2 * (processes - 1) / processes * rows
    assert sent[1] == pytest.approx(gathered)
    assert sent[1] < 4 * size / 20  # dense float32 would be 4 bytes a value


@pytest.mark.parametrize("payload, message", [
    ("sparse:0", "ratio '0' must be a number in"),
    ("sparse:1.5", "ratio '1.5'"),
    ("sparse:abc", "ratio 'abc'"),
    ("sparse2", "payload='sparse2' must be None or one of"),
])
def test_bad_sparse_payloads_are_refused_when_built(payload, message):
  with pytest.raises(ValueError, match=message):
    jdist.diloco(optax.sgd(0.1), sync_every=4, payload=payload)
  with pytest.raises(ValueError, match="ratio=0"):
    sparseloco.check_ratio(0)


def test_the_flag_takes_a_ratio_and_names_a_bad_one():
  config = config_lib.TrainConfig(diloco=16, diloco_payload="sparse:0.01")
  config_lib.validate(config)
  with pytest.raises(config_lib.ConfigError,
                     match=r"--diloco-payload\)='sparse:2' is not one of .*ratio '2'"):
    config_lib.validate(config_lib.TrainConfig(diloco=16, diloco_payload="sparse:2"))
  assert diloco_lib.payload_codec("sparse") == diloco_lib.SparseCodec(sparseloco.DEFAULT_RATIO)
