"""The "callback" route: several devices per process where the native engine is not built.

Hierarchical: the devices first reduce-scatter the buffer locally (XLA),
then device d of every process exchanges its 1/D shard on its own
communicator through a host callback running mpi4py, then the devices
all-gather the shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jdist.collectives.routes import base
from jdist.runtime import flight_recorder
from jdist.collectives.routes.base import Route
from jdist.collectives.routes.base import bits
from jdist.collectives.routes.base import from_bits
from jdist.collectives.routes.base import local_sum16
from jdist.collectives.routes.base import pad_to


# On the callback route each device's host callback blocks an XLA thread in
# MPI, so the exchanges of one step must run in one order on every device of
# every process: XLA:CPU runs independent operations in whatever order they
# become ready, and device 0 of process A waiting in exchange X's local
# all-gather for device 1, itself in exchange Y's MPI call waiting for process
# B, where the roles are swapped, is a deadlock (seen in 2x2 with a flag
# all-reduce beside a top-K all-gather). `base.chain_input` makes each
# exchange's input depend on the previous exchange's output in the trace
# (`chained`: `base.exchange` does it around the exchange's primitive).
after_previous_exchange = base.chain_input
exchange_done = base.chain_output


def host_callback(host_fn, axis: str, result: jax.ShapeDtypeStruct, *args):
  """`host_fn(*args, device)` on the host, per device of `axis`, inside the step."""
  device = lax.axis_index(axis)

  def on_host(*arrays):
    # pure_callback passes jax.Arrays; any JAX op on them (even a reshape)
    # would start a computation from inside this step and can deadlock.
    return host_fn(*(np.asarray(a) for a in arrays))

  return jax.pure_callback(on_host, result, *args, device, vmap_method="sequential")


class CallbackRoute(Route):
  """Host callbacks running mpi4py, device d of every process on `device_comm(d)`.

  The host side runs on XLA's device threads, one per local device, each on
  its own communicator.
  """

  name = "callback"
  chained = True

  def __init__(self, topology, world):
    super().__init__(topology)
    self.world = world

  def _recorded(self, host_fn, kind: str, ordinal: int, buffer: jax.Array):
    """`host_fn` (its last argument the device), in the flight recorder."""
    nbytes, devices = buffer.nbytes, self.devices

    def run(*args):
      key = flight_recorder.device_posted(int(args[-1]), ordinal, kind, nbytes, devices)
      try:
        return host_fn(*args)
      finally:
        flight_recorder.device_done(key)
    return run

  def _host_allreduce(self, shard: np.ndarray, device: np.ndarray) -> np.ndarray:
    out = np.empty_like(shard)
    self.world.device_comm(int(device)).Allreduce(np.ascontiguousarray(shard), out,
                                                  op=self.world.MPI.SUM)
    return out

  def _host_allgather(self, piece: np.ndarray, device: np.ndarray) -> np.ndarray:
    out = np.empty((self.world.size,) + piece.shape, piece.dtype)
    self.world.device_comm(int(device)).Allgather(np.ascontiguousarray(piece), out)
    return out

  def _host_sum16(self, coded: np.ndarray, is_bf16: np.ndarray,
                  device: np.ndarray) -> np.ndarray:
    """Sums uint16-coded 16-bit floats over processes, accumulating in float32."""
    comm = self.world.device_comm(int(device))
    dtype = np.dtype(jnp.bfloat16) if int(is_bf16) else np.dtype(np.float16)
    chunks = coded.reshape(self.world.size, -1)
    received = np.empty_like(chunks)
    comm.Alltoall(np.ascontiguousarray(chunks), received)
    mine = received.view(dtype).astype(np.float32).sum(axis=0).astype(dtype).view(np.uint16)
    out = np.empty_like(chunks)
    comm.Allgather(mine, out)
    return out.reshape(coded.shape)

  def _sum(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    devices, size = self.devices, buffer.shape[0]
    shard = pad_to(buffer, devices)
    if devices > 1:
      shard = lax.psum_scatter(shard, axis, tiled=True)
    shard = host_callback(self._recorded(self._host_allreduce, base.SUM, ordinal, buffer),
                          axis, jax.ShapeDtypeStruct(shard.shape, shard.dtype), shard)
    if devices > 1:
      shard = lax.all_gather(shard, axis, tiled=True)
    return shard[:size]

  def _sum16(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    dtype, devices, size = buffer.dtype, self.devices, buffer.shape[0]
    padded = pad_to(buffer, devices * self.processes)
    shard = local_sum16(padded, devices, axis).astype(dtype) if devices > 1 else padded
    is_bf16 = np.int32(dtype == jnp.bfloat16)
    shard_bits = host_callback(self._recorded(self._host_sum16, base.SUM16, ordinal, buffer),
                               axis, jax.ShapeDtypeStruct(shard.shape, jnp.uint16),
                               bits(shard), is_bf16)
    shard = from_bits(shard_bits, dtype)
    if devices > 1:
      shard = lax.all_gather(shard, axis, tiled=True)
    return shard[:size]

  def _gather(self, buffer: jax.Array, ordinal: int, axis: str) -> jax.Array:
    processes, devices = self.processes, self.devices
    per_process = host_callback(
        self._recorded(self._host_allgather, base.GATHER, ordinal, buffer), axis,
        jax.ShapeDtypeStruct((processes,) + buffer.shape, buffer.dtype),
        buffer)
    if devices == 1:
      return per_process
    stacked = lax.all_gather(per_process, axis)  # [D, P, n]
    return jnp.swapaxes(stacked, 0, 1).reshape((processes * devices,) + buffer.shape)
