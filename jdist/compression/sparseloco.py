"""SparseLoCo's payload: the top entries of each chunk, in 2 bits, indices packed.

SparseLoCo (arXiv 2508.15706) sends DiLoCo's pseudo-gradient as the top-k
entries of each chunk, their values quantized to 2 bits, with error
feedback. `jdist.diloco(payload="sparse")` sends it so:

* the flattened pseudo-gradient (plus the residual) is cut into chunks of
  `CHUNK` entries (the fragment's size if smaller); in each, the
  k = ceil(ratio * chunk) largest magnitudes are kept (`lax.top_k` per row);
* each kept value becomes a 2-bit code: its sign and one magnitude bit,
  "above the chunk's mean magnitude or not"; the chunk sends two float32
  scales, the mean magnitude of the kept values below and above that mean
  (a two-level Lloyd-Max step per chunk), and decodes to sign * scale;
* an entry's index travels as its uint16 offset in its chunk.

Per kept entry the wire carries 2 bytes of offset and a quarter byte of
code (`pack4.pack_fields`), plus 8 bytes per chunk: 2.25 + 8 / k bytes per
kept entry, against 4 per entry of the whole vector for float32. Codes
cannot be summed on the wire, so every replica's bytes are all-gathered
(`protocol.Exchange.gather`, as `jdist.topk`'s payload) and decoded,
scatter-added and averaged in float32.

`encode` returns what the other replicas will decode too: the caller keeps
`x - decoded` as the residual (error feedback), so sent + residual = x
exactly; entries not selected stay whole in the residual.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdist import fusion
from jdist.compression import pack4
from jdist.compression import protocol
from jdist.compression import sparse

CHUNK = 4096  # entries per chunk; offsets in a chunk fit uint16
CODE_BITS = 2  # sign + magnitude bit
# Fraction of each chunk sent. Measured on the main job (digits CNN, 2x1,
# --diloco 16, 12 epochs; docs/diloco.md): see the table there.
DEFAULT_RATIO = 0.02


def check_ratio(ratio: Any) -> float:
  """`ratio` as a float in (0, 1].

  Raises:
    ValueError: anything else, naming the value.
  """
  if (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
      or not (math.isfinite(ratio) and 0 < ratio <= 1)):
    raise ValueError(f"ratio={ratio!r} must be a fraction in (0, 1] of each chunk's entries "
                     f"to send, e.g. {DEFAULT_RATIO} (SparseLoCo sends 1-3%).")
  return float(ratio)


@dataclasses.dataclass(frozen=True)
class SparseLoCoCtx:
  """How a `SparseLoCoPayload` turns back into a tree.

  Attributes:
    spec: the dense tree, as one flat vector.
    chunk: entries per chunk (the last one zero-padded).
    kept: entries sent per chunk.
  """
  spec: fusion.FlatSpec
  chunk: int
  kept: int

  @property
  def chunks(self) -> int:
    return -(-self.spec.size // self.chunk)


def context(spec: fusion.FlatSpec, ratio: float) -> SparseLoCoCtx:
  """The chunks of a flat vector of `spec.size` entries and the entries kept of each."""
  chunk = max(1, min(CHUNK, spec.size))
  return SparseLoCoCtx(spec, chunk, max(1, math.ceil(ratio * chunk)))


def quantize(values: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(uint8 codes [..., k] in 0..3, float32 scales [..., 2]) of `values` [..., k].

  A code is 2 * (value < 0) + (|value| > the row's mean |value|); scales
  [low, high] are the mean magnitudes of the row's values at or below and
  above that mean (0 for an empty side).
  """
  magnitude = jnp.abs(values)
  high = magnitude > jnp.mean(magnitude, axis=-1, keepdims=True)

  def side_mean(mask):
    count = jnp.sum(mask, axis=-1)
    return jnp.sum(jnp.where(mask, magnitude, 0.0), axis=-1) / jnp.maximum(count, 1)

  scales = jnp.stack([side_mean(~high), side_mean(high)], axis=-1)
  codes = 2 * (values < 0).astype(jnp.uint8) + high.astype(jnp.uint8)
  return codes, scales


def dequantize(codes: jax.Array, scales: jax.Array) -> jax.Array:
  """The float32 values of `quantize`'s codes [..., k] and scales [..., 2]."""
  magnitude = jnp.take_along_axis(scales, (codes & 1).astype(jnp.int32), axis=-1)
  return jnp.where(codes >= 2, -magnitude, magnitude)


@jax.tree_util.register_pytree_node_class
class SparseLoCoPayload(protocol.WirePayload):
  """Kept entries of each chunk: uint16 `offsets` and uint8 `codes` [chunks, kept],
  float32 `scales` [chunks, 2]."""

  def __init__(self, offsets: jax.Array, codes: jax.Array, scales: jax.Array,
               ctx: SparseLoCoCtx):
    self.offsets, self.codes, self.scales, self.ctx = offsets, codes, scales, ctx

  def tree_flatten(self):
    return (self.offsets, self.codes, self.scales), self.ctx

  @classmethod
  def tree_unflatten(cls, ctx, children):
    return cls(*children, ctx)

  def to_wire(self) -> jax.Array:
    """This replica's bytes: [offsets | codes packed four per byte | scales]."""
    return jnp.concatenate([sparse.to_bytes(self.offsets),
                            pack4.pack_fields(self.codes.reshape(-1), CODE_BITS),
                            sparse.to_bytes(self.scales)])

  def reduce_over_replicas(self, exchange: protocol.Exchange, factor: float) -> Any:
    """All-gathers every replica's `to_wire` bytes; decodes, sums in float32."""
    return fusion.unravel(decode_sum(exchange.gather(self.to_wire()), self.ctx) * factor,
                          self.ctx.spec)

  def __repr__(self):
    return (f"SparseLoCoPayload(n={self.ctx.spec.size}, chunk={self.ctx.chunk}, "
            f"kept={self.ctx.kept})")


def wire_size(ctx: SparseLoCoCtx) -> int:
  """Bytes of one replica's `to_wire` buffer."""
  entries = ctx.chunks * ctx.kept
  return 2 * entries + pack4.packed_size(entries, CODE_BITS) + 8 * ctx.chunks


def decode_sum(everyone: jax.Array, ctx: SparseLoCoCtx) -> jax.Array:
  """The float32 sum [n] of every replica's decoded entries, from their bytes [R, wire_size]."""
  entries, chunks = ctx.chunks * ctx.kept, ctx.chunks
  code_bytes = pack4.packed_size(entries, CODE_BITS)
  offsets = sparse.from_bytes(everyone[:, :2 * entries], jnp.uint16, entries)
  codes = pack4.unpack_fields(everyone[:, 2 * entries:2 * entries + code_bytes], entries,
                              CODE_BITS)
  scales = sparse.from_bytes(everyone[:, 2 * entries + code_bytes:], jnp.float32, 2 * chunks)
  values = dequantize(codes.reshape(-1, chunks, ctx.kept), scales.reshape(-1, chunks, 2))
  starts = (jnp.arange(chunks, dtype=jnp.int32) * ctx.chunk)[None, :, None]
  indices = offsets.reshape(-1, chunks, ctx.kept).astype(jnp.int32) + starts
  dense = jnp.zeros((chunks * ctx.chunk,), jnp.float32)
  return dense.at[indices.reshape(-1)].add(values.reshape(-1))[:ctx.spec.size]


def encode(x: jax.Array, spec: fusion.FlatSpec,
           ratio: float) -> tuple[SparseLoCoPayload, jax.Array]:
  """The payload of a flat float32 `x`, and what every replica decodes of it ([n]).

  Args:
    x: the vector to send (pseudo-gradient plus residual), flattened.
    spec: the tree `x` unravels to.
    ratio: fraction of each chunk sent, in (0, 1].
  """
  ctx = context(spec, ratio)
  rows = jnp.pad(x, (0, ctx.chunks * ctx.chunk - x.shape[0])).reshape(ctx.chunks, ctx.chunk)
  _, offsets = lax.top_k(jnp.abs(rows), ctx.kept)
  codes, scales = quantize(jnp.take_along_axis(rows, offsets, axis=1))
  payload = SparseLoCoPayload(offsets.astype(jnp.uint16), codes, scales, ctx)
  return payload, decode_sum(payload.to_wire()[None], ctx)
