"""jdist.compression.pack4: 4-bit levels, two per byte, and the 4-bit quantizer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdist.compression import pack4
from jdist.compression import qsgd


@pytest.mark.parametrize("size", [1, 6, 17])
def test_pack_round_trips_every_level_in_half_the_bytes(size):
  levels = np.resize(np.arange(-8, 8, dtype=np.int8), size)
  packed = pack4.pack(jnp.asarray(levels))
  assert packed.dtype == jnp.uint8 and packed.shape == ((size + 1) // 2,)
  np.testing.assert_array_equal(np.asarray(pack4.unpack(packed, size)), levels)
  # Entry 2i is byte i's low nibble, 2i + 1 its high one (two's complement).
  byte = np.asarray(packed)[0]
  assert byte & 0xF == levels[0] & 0xF
  if size > 1:
    assert byte >> 4 == levels[1] & 0xF


def test_unpack_takes_rows_of_gathered_bytes():
  rows = np.array([[3, -7, 0], [-1, 7, 5]], np.int8)
  packed = jnp.stack([pack4.pack(jnp.asarray(row)) for row in rows])
  np.testing.assert_array_equal(np.asarray(pack4.unpack(packed, 3)), rows)


def test_pack_rejects_arrays_that_are_not_flat():
  with pytest.raises(ValueError, match=r"levels has shape \(2, 2\)"):
    pack4.pack(jnp.zeros((2, 2), jnp.int8))


@pytest.mark.parametrize("bits", [8, 4])
def test_nearest_rounding_is_within_half_a_level(bits):
  x = jax.random.normal(jax.random.key(0), (700,), jnp.float32)
  top = qsgd.max_level(bits)
  levels, scales = qsgd.quantize(x, None, 256, top)
  assert int(jnp.abs(levels).max()) == top  # each block's largest value is exact
  decoded = qsgd.dequantize(levels, scales, 256, top)[:700]
  step = np.repeat(np.asarray(scales), 256)[:700] / top
  assert np.all(np.abs(np.asarray(decoded - x)) <= step / 2 + 1e-7)
