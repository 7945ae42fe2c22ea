"""4-bit levels on the wire: two signed nibbles per byte.

`jdist.diloco(payload="int4")` quantizes with `qsgd.quantize` to the levels
-7..7 (one float32 scale per block) and sends those levels packed here, so
the bytes that cross processes are half a byte per value, not an int8 array
with four bits unused. Entry 2i is the low nibble of byte i, entry 2i + 1
the high one, each in 4-bit two's complement (-8..7 fit; the quantizer uses
-7..7 so that the levels are symmetric around 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

LEVELS = 7  # the largest magnitude `qsgd.quantize` gives 4-bit levels


def packed_size(size: int) -> int:
  """Bytes that hold `size` 4-bit levels."""
  return -(-size // 2)


def pack(levels: jax.Array) -> jax.Array:
  """int8 `levels` [n], each in -8..7, as uint8 [ceil(n / 2)] (an odd n gets a 0 nibble)."""
  if levels.ndim != 1:
    raise ValueError(f"levels has shape {levels.shape}; pack takes a 1-D array.")
  nibbles = lax.bitcast_convert_type(levels.astype(jnp.int8), jnp.uint8) & 0xF
  nibbles = jnp.pad(nibbles, (0, 2 * packed_size(levels.shape[0]) - levels.shape[0]))
  pairs = nibbles.reshape(-1, 2)
  return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack(packed: jax.Array, size: int) -> jax.Array:
  """The int8 levels [..., size] of `pack`ed bytes [..., ceil(size / 2)]."""
  signed = lax.bitcast_convert_type(packed, jnp.int8)
  # Shift each nibble to the top of an int8, then back: the arithmetic shift
  # restores its sign.
  low = (signed << 4) >> 4
  high = signed >> 4
  levels = jnp.stack([low, high], axis=-1).reshape(packed.shape[:-1] + (-1,))
  return levels[..., :size]
