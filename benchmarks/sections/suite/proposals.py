"""Prototypes of changes proposed for jdist, timed beside jdist's own code.

Nothing here is used by jdist. (The block top-K prototype that was here is
now `jdist.topk(method="block")`, and `add_rows` is in jdist's transport
since commit 6e0c252; the benchmarks measure jdist's versions.)

* `sum_rows_axis0(chunks)`: the float32 accumulation of the 16-bit exchange
  before 6e0c252, `.sum(axis=0)` of `[P, n/P]`, which XLA:CPU runs as a
  strided column reduction (~100 ms for 16 MB here), against
* `add_rows(chunks)`: the P rows added elementwise (P is static and small),
  one vectorized pass (~1.5 ms);
* `fp16_allreduce_mpi4jax(x)`: the 16-bit mpi4jax route (all-to-all,
  float32 sum, all-gather) written directly with `add_rows`: what jdist's
  `cast` + `allreduce` should cost, without its bookkeeping.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def sum_rows_axis0(chunks: jax.Array) -> jax.Array:
  """jdist's accumulation before 6e0c252: float32 `.sum(axis=0)` of 16-bit rows."""
  return chunks.astype(jnp.float32).sum(axis=0).astype(chunks.dtype)


def add_rows(chunks: jax.Array) -> jax.Array:
  """The accumulation jdist uses since 6e0c252: rows added elementwise in float32."""
  rows = [chunks[i].astype(jnp.float32) for i in range(chunks.shape[0])]
  return functools.reduce(jnp.add, rows).astype(chunks.dtype)


def fp16_allreduce_mpi4jax(x: jax.Array, comm, dtype=jnp.float16) -> jax.Array:
  """Mean of a float32 buffer over processes, 16 bits on the wire (one device each)."""
  import mpi4jax  # pylint: disable=import-outside-toplevel
  processes = comm.Get_size()
  n = x.shape[0]
  scaled = (x / processes).astype(dtype)
  chunks = jnp.pad(scaled, (0, -n % processes)).reshape(processes, -1)
  received = mpi4jax.alltoall(lax.bitcast_convert_type(chunks, jnp.uint16), comm=comm)
  mine = add_rows(lax.bitcast_convert_type(received, dtype))
  gathered = mpi4jax.allgather(lax.bitcast_convert_type(mine, jnp.uint16), comm=comm)
  return lax.bitcast_convert_type(gathered, dtype).reshape(-1)[:n].astype(jnp.float32)
