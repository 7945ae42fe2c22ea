"""The "mpi4jax" route: one device per process, mpi4jax collectives inside the step.

Zero-copy on CPU; mpi4jax's ordered effects allow only one device per
process.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jdist.collectives.routes.base import DATA_AXIS
from jdist.runtime import world as world_lib
from jdist.collectives.routes.base import Route
from jdist.collectives.routes.base import add_rows
from jdist.collectives.routes.base import bits
from jdist.collectives.routes.base import from_bits
from jdist.collectives.routes.base import pad_to


class Mpi4jaxRoute(Route):
  """mpi4jax collectives on the world's device communicator 0 (one device each)."""

  name = "mpi4jax"

  def __init__(self, topology, world):
    super().__init__(topology)
    self.world = world

  def _comm(self):
    return self.world.device_comm(0)

  @functools.cache  # pylint: disable=method-cache-max-size-none
  def effects(self):
    """mpi4jax's ordered effect, read from a traced call (it has no public name)."""
    probe = jax.ShapeDtypeStruct((1,), jnp.float32)
    return frozenset(jax.make_jaxpr(lambda x: self._sum(x, -1, DATA_AXIS))(probe).effects)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    mpi4jax = world_lib.import_mpi4jax()
    return mpi4jax.allreduce(buffer, op=self.world.MPI.SUM, comm=self._comm())

  def _sum16(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    mpi4jax = world_lib.import_mpi4jax()
    dtype, processes = buffer.dtype, self.processes
    chunks = bits(pad_to(buffer, processes).reshape(processes, -1))
    received = mpi4jax.alltoall(chunks, comm=self._comm())
    mine = add_rows(from_bits(received, dtype)).astype(dtype)
    gathered = mpi4jax.allgather(bits(mine), comm=self._comm())
    return from_bits(gathered, dtype).reshape(-1)[:buffer.shape[0]]

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    return world_lib.import_mpi4jax().allgather(buffer, comm=self._comm())
