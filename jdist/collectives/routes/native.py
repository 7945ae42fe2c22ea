"""The "native" route: one XLA FFI custom call per exchange and device into jdist's C++ engine.

The engine reduces the local devices' parts and runs MPI across processes
without blocking any XLA thread (`jdist.collectives.native`). The default
wherever the engine runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jdist.collectives import native
from jdist.collectives.routes.base import Route


class NativeRoute(Route):
  """jdist's C++ engine, one FFI custom call per exchange and device."""

  name = "native"

  def join(self, buffers: list[jax.Array]) -> list[jax.Array]:
    """Every reduced bucket, read only once all of them are: lets the exchanges
    run beside the rest of the backward pass (`native.join`)."""
    return native.join(buffers)

  def process_index_value(self) -> jax.Array:
    """Read at run time on CPU (no literal in the program at all), else behind a barrier."""
    value = native.process_index_value()
    return super().process_index_value() if value is None else value

  def _call(self, kind: int, buffer: jax.Array, result: jax.ShapeDtypeStruct,
            ordinal: int, axis: str) -> jax.Array:
    return native.call(kind, buffer, result, ordinal, axis)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    """Any numeric dtype: those the engine sums directly, others through them."""
    dtype = buffer.dtype
    if buffer.size == 0:
      return buffer
    if np.dtype(dtype) in native.SUM_DTYPES:
      return self._call(native.SUM, buffer, jax.ShapeDtypeStruct(buffer.shape, dtype), ordinal,
                        axis)
    if jnp.issubdtype(dtype, jnp.complexfloating):  # a sum of (real, imag) pairs
      parts = jnp.stack([buffer.real, buffer.imag], axis=-1).reshape(-1)
      summed = self._sum(parts, ordinal, axis).reshape(-1, 2)
      return lax.complex(summed[:, 0], summed[:, 1]).astype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):  # float8 and friends: in float32
      return self._sum(buffer.astype(jnp.float32), ordinal, axis).astype(dtype)
    wide = jnp.int64 if jnp.dtype(dtype).itemsize == 8 else jnp.int32
    return self._sum(buffer.astype(wide), ordinal, axis).astype(dtype)  # bools, small ints

  def _sum16(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    if buffer.shape[0] == 0:
      return buffer
    return self._call(native.SUM16, buffer, jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
                      ordinal, axis)

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    return self._call(native.GATHER, buffer,
                      jax.ShapeDtypeStruct((self.replicas,) + buffer.shape, buffer.dtype),
                      ordinal, axis)
