"""Reductions of pytrees over every replica, for use inside a pmapped step.

`psum`, `pmean` and `all_gather` reduce over every replica of the job: the
local devices of this process (XLA collectives over `DATA_AXIS`), then the
processes (see `transport`). Across processes a pytree travels fused: one
flat buffer per dtype and bucket, not one MPI call per leaf.

`reduce_payload` is what `jdist.allreduce` calls: it accepts the gradient
tree itself or a compressed payload (`payloads.HalfPayload`,
`payloads.SparsePayload`) and picks the wire format from its type.

Before a pytree first crosses processes, its structure, shapes and dtypes are
compared across processes (at trace time, one small host exchange), so a
mismatch is an error on every rank that names the first differing leaf,
instead of a hang or silently mixed buffers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdist import errors
from jdist.collectives import context
from jdist import fusion
from jdist.collectives import payloads
from jdist.collectives import transport
from jdist.runtime import host
from jdist.collectives.transport import DATA_AXIS


def require_data_parallel(what: str) -> None:
  """Raises a clear error unless traced in a data-parallel step (either kind).

  See `jdist.collectives.context`: a `jdist.data_parallel` step, or a jit
  step over global arrays under `jax.set_mesh(jdist.mesh())`.
  """
  context.in_global_step(what)


def _fused(tree: Any, what: str, reduce_buffer, bucket_bytes: int,
           fuse_local: bool = False) -> Any:
  """Applies `reduce_buffer` to the tree's leaves, fused into buckets.

  Within one process XLA already combines per-leaf all-reduces, so plain sums
  skip the concatenation there (`fuse_local=False`).
  """
  if transport.route() == "local" and not fuse_local:
    return jax.tree.map(lambda leaf: reduce_buffer(leaf.reshape(-1)).reshape(leaf.shape), tree)
  host.check_structure(tree, what)
  leaves, treedef = jax.tree.flatten(tree)
  shapes = [leaf.shape for leaf in leaves]
  out = {}
  for bucket in fusion.plan_buckets(leaves, bucket_bytes):
    out.update(fusion.unpack(reduce_buffer(fusion.pack(leaves, bucket)), bucket, shapes))
  return jax.tree.unflatten(treedef, [out[i] for i in range(len(leaves))])


def psum(tree: Any, *, bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> Any:
  """Sum of `tree` over every replica (inside `jdist.data_parallel`)."""
  if context.in_global_step("jdist.psum"):
    return context.per_process(functools.partial(psum, bucket_bytes=bucket_bytes), tree)
  if not jax.tree.leaves(tree):
    return tree
  return _fused(tree, "jdist.psum", transport.sum_all, bucket_bytes)


def pmean(tree: Any, *, bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> Any:
  """Mean of `tree` over every replica; integer leaves are averaged as floats."""
  if context.in_global_step("jdist.pmean"):
    return context.per_process(functools.partial(pmean, bucket_bytes=bucket_bytes), tree)
  replicas = context.participant_count()
  as_float = jax.tree.map(
      lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32), tree)
  summed = psum(as_float, bucket_bytes=bucket_bytes)
  return jax.tree.map(lambda x: (x / replicas).astype(x.dtype), summed)


def all_gather(tree: Any) -> Any:
  """Every replica's value of each leaf, stacked: leaves get a leading [R] axis.

  Replicas are in global order (process-major, then local device); in a
  global (jit) step, one row per process.
  """
  if context.in_global_step("jdist.all_gather"):
    return context.per_process(lambda t: context.gather_rows_per_process(all_gather(t)), tree,
                               first_only=False)
  return jax.tree.map(
      lambda leaf: transport.gather_all(leaf.reshape(-1)).reshape((-1,) + leaf.shape), tree)


def _to_bytes(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(x: jax.Array, dtype, count: int) -> jax.Array:
  width = jnp.dtype(dtype).itemsize
  return lax.bitcast_convert_type(x.reshape(count, width), dtype)


def _reduce_sparse(payload: payloads.SparsePayload, factor: float) -> Any:
  """All-gathers every replica's (values, indices) as one byte buffer; scatter-adds."""
  values, indices = payload.values, payload.indices.astype(jnp.int32)
  count = values.shape[0]
  wire = jnp.concatenate([_to_bytes(values), _to_bytes(indices)])
  everyone = transport.gather_all(wire)  # [R, bytes]
  value_bytes = count * values.dtype.itemsize
  all_values = jax.vmap(lambda b: _from_bytes(b[:value_bytes], values.dtype, count))(everyone)
  all_indices = jax.vmap(lambda b: _from_bytes(b[value_bytes:], jnp.int32, count))(everyone)
  # Scale the R*k gathered values, not the n dense entries: one pass fewer.
  scaled = all_values.reshape(-1).astype(jnp.float32) * (factor / payload.ctx.scale)
  dense = jnp.zeros((payload.ctx.spec.size,), jnp.float32).at[all_indices.reshape(-1)].add(scaled)
  return fusion.unravel(dense, payload.ctx.spec)


def _reduce_half(payload: payloads.HalfPayload, factor: float, bucket_bytes: int) -> Any:
  summed = _fused(payload.tree, "jdist.allreduce (16-bit)",
                  lambda b: transport.sum_all_16bit(b) if b.dtype in payloads.HALF_DTYPES
                  else transport.sum_all(b), bucket_bytes, fuse_local=True)
  return payloads.from_half(summed, payload.ctx, factor)


def reduce_payload(updates: Any, *, mean: bool = True,
                   bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> Any:
  """Sum or mean over every replica of a gradient tree or a compressed payload.

  Args:
    updates: a pytree of arrays, a `HalfPayload` or a `SparsePayload`.
    mean: divide by the replica count (else sum).
    bucket_bytes: fusion bucket size for dense and 16-bit exchanges.

  Returns:
    The reduced gradient tree, leaves in their original dtypes.
  """
  if context.in_global_step("jdist.allreduce"):
    return context.per_process(
        functools.partial(reduce_payload, mean=mean, bucket_bytes=bucket_bytes), updates)
  factor = 1.0 / context.participant_count() if mean else 1.0
  if isinstance(updates, payloads.SparsePayload):
    return _reduce_sparse(updates, factor)
  if isinstance(updates, payloads.HalfPayload):
    return _reduce_half(updates, factor, bucket_bytes)
  summed = psum(updates, bucket_bytes=bucket_bytes)
  if not mean:
    return summed
  return jax.tree.map(lambda x: (x * factor).astype(x.dtype), summed)
