"""The "local" route: one process, or JAX's multi-process runtime (backend "jax").

XLA collectives over `DATA_AXIS` already span every replica: nothing of
jdist crosses processes.
"""

from __future__ import annotations

import jax
from jax import lax

from jdist.collectives.routes import base
from jdist.collectives.routes.base import DATA_AXIS
from jdist.collectives.routes.base import Route
from jdist.collectives.routes.base import local_sum16
from jdist.collectives.routes.base import pad_to


class LocalRoute(Route):
  """XLA collectives over `DATA_AXIS`, which span every replica."""

  name = "local"

  def sum_all(self, buffer: jax.Array, axis: str = DATA_AXIS) -> jax.Array:
    if self.processes > 1:  # backend "jax": XLA's collectives cross processes
      base.add_to_ledger(2 * (self.processes - 1) / self.processes * buffer.nbytes, 1)
    return lax.psum(buffer, axis)

  def _exchange(self, kind: str, buffer: jax.Array, axis: str) -> jax.Array:
    # XLA's collectives: differentiable and batchable as they are.
    return self.lower(kind, buffer, -1, axis)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    return lax.psum(buffer, axis)

  def _sum16(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    axis_size = lax.axis_size(axis)
    if axis_size == 1:
      return buffer
    padded = pad_to(buffer, axis_size)
    shard = local_sum16(padded, axis_size, axis).astype(buffer.dtype)
    return lax.all_gather(shard, axis, tiled=True)[:buffer.shape[0]]

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    return lax.all_gather(buffer, axis)
