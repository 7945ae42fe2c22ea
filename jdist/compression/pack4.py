"""Narrow codes on the wire: 4-bit levels two per byte, 2-bit codes four per byte.

`jdist.diloco(payload="int4")` quantizes with `qsgd.quantize` to the levels
-7..7 (one float32 scale per block) and sends those levels packed here, so
the bytes that cross processes are half a byte per value, not an int8 array
with four bits unused. Entry 2i is the low nibble of byte i, entry 2i + 1
the high one, each in 4-bit two's complement (-8..7 fit; the quantizer uses
-7..7 so that the levels are symmetric around 0).

`pack_fields`/`unpack_fields` are the unsigned layout underneath, for any
field width that divides 8: entry j is the field (j % (8 / bits)) of byte
j // (8 / bits), lowest bits first. `jdist.diloco(payload="sparse")` sends
its 2-bit codes with them (`jdist.compression.sparseloco`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

LEVELS = 7  # the largest magnitude `qsgd.quantize` gives 4-bit levels
FIELD_BITS = (1, 2, 4)  # field widths that divide a byte


def packed_size(size: int, bits: int = 4) -> int:
  """Bytes that hold `size` fields of `bits` bits."""
  per_byte = 8 // bits
  return -(-size // per_byte)


def pack_fields(codes: jax.Array, bits: int) -> jax.Array:
  """uint8 `codes` [n], each < 2**bits, as uint8 [packed_size(n, bits)] (the tail zero-filled)."""
  if bits not in FIELD_BITS:
    raise ValueError(f"bits={bits!r} must be one of {FIELD_BITS}.")
  if codes.ndim != 1:
    raise ValueError(f"codes has shape {codes.shape}; pack_fields takes a 1-D array.")
  per_byte = 8 // bits
  size = codes.shape[0]
  fields = jnp.pad(codes.astype(jnp.uint8) & ((1 << bits) - 1),
                   (0, per_byte * packed_size(size, bits) - size)).reshape(-1, per_byte)
  shifts = (jnp.arange(per_byte, dtype=jnp.uint8) * bits)[None, :]
  return jnp.bitwise_or.reduce(fields << shifts, axis=1).astype(jnp.uint8)


def unpack_fields(packed: jax.Array, size: int, bits: int) -> jax.Array:
  """The uint8 codes [..., size] of `pack_fields`'d bytes [..., packed_size(size, bits)]."""
  if bits not in FIELD_BITS:
    raise ValueError(f"bits={bits!r} must be one of {FIELD_BITS}.")
  per_byte = 8 // bits
  shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
  fields = (packed[..., None] >> shifts) & ((1 << bits) - 1)
  return fields.reshape(packed.shape[:-1] + (-1,))[..., :size].astype(jnp.uint8)


def pack(levels: jax.Array) -> jax.Array:
  """int8 `levels` [n], each in -8..7, as uint8 [ceil(n / 2)] (an odd n gets a 0 nibble)."""
  if levels.ndim != 1:
    raise ValueError(f"levels has shape {levels.shape}; pack takes a 1-D array.")
  return pack_fields(lax.bitcast_convert_type(levels.astype(jnp.int8), jnp.uint8), 4)


def unpack(packed: jax.Array, size: int) -> jax.Array:
  """The int8 levels [..., size] of `pack`ed bytes [..., ceil(size / 2)]."""
  nibbles = lax.bitcast_convert_type(unpack_fields(packed, size, 4) << 4, jnp.int8)
  # Each nibble sits at the top of an int8: the arithmetic shift restores its sign.
  return nibbles >> 4
