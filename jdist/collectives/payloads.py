"""What goes on the wire, and how to turn it back.

Compression in jdist is a pair, as in Horovod's compress/decompress: a
transformation (`jdist.cast`, `jdist.topk`, `jdist.threshold`) hands the next
`jdist.allreduce` a payload node instead of the gradient tree, and the node
carries its context (original dtypes, shapes, the pre-division factor) as
static aux data. The collective layer picks the wire format from the node's
type:

  * a plain pytree of arrays        -> fused dense all-reduce
  * `HalfPayload` (16-bit leaves)   -> 16-bit exchange, float32 accumulation
  * `SparsePayload` (values+indices) -> all-gather of the selected entries

Both node types are registered pytrees, so they pass through `jax.jit`,
`jax.pmap` and `optax.chain` like any gradient tree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.fusion import FlatSpec

HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class HalfCtx:
  """How a `HalfPayload` turns back into gradients."""
  dtypes: tuple[Any, ...]  # original dtype of each leaf, in leaf order
  scale: float  # leaves were multiplied by `scale` before the cast


@jax.tree_util.register_pytree_node_class
class HalfPayload:
  """A gradient tree whose leaves travel in 16 bits, pre-scaled."""

  def __init__(self, tree: Any, ctx: HalfCtx):
    self.tree = tree
    self.ctx = ctx

  def tree_flatten(self):
    return (self.tree,), self.ctx

  @classmethod
  def tree_unflatten(cls, ctx, children):
    return cls(children[0], ctx)

  def __repr__(self):
    return f"HalfPayload({self.tree!r}, scale={self.ctx.scale})"


@dataclasses.dataclass(frozen=True)
class SparseCtx:
  """How a `SparsePayload` turns back into a gradient tree."""
  spec: FlatSpec  # the dense tree, as one flat vector
  scale: float  # values were multiplied by `scale` before sending


@jax.tree_util.register_pytree_node_class
class SparsePayload:
  """Selected entries of the flattened gradient: `values` at `indices`.

  Shapes are static: `values` and `indices` have the same length k on every
  replica (unused slots hold value 0 at index 0, which adds nothing).
  """

  def __init__(self, values: jax.Array, indices: jax.Array, ctx: SparseCtx):
    self.values = values
    self.indices = indices
    self.ctx = ctx

  def tree_flatten(self):
    return (self.values, self.indices), self.ctx

  @classmethod
  def tree_unflatten(cls, ctx, children):
    return cls(children[0], children[1], ctx)

  def with_values(self, values: jax.Array, scale: float) -> "SparsePayload":
    return SparsePayload(values, self.indices, dataclasses.replace(self.ctx, scale=scale))

  def __repr__(self):
    return f"SparsePayload(k={self.values.shape[-1]}, n={self.ctx.spec.size})"


def is_payload(x: Any) -> bool:
  return isinstance(x, (HalfPayload, SparsePayload))


def to_half(tree: Any, dtype: Any, scale: float) -> HalfPayload:
  """Compress: scale, then cast every floating leaf to the 16-bit `dtype`."""
  leaves, treedef = jax.tree.flatten(tree)
  dtypes = tuple(np.dtype(l.dtype) for l in leaves)
  cast = [(l * scale).astype(dtype) if jnp.issubdtype(l.dtype, jnp.floating) else l
          for l in leaves]
  return HalfPayload(jax.tree.unflatten(treedef, cast), HalfCtx(dtypes, scale))


def from_half(tree16: Any, ctx: HalfCtx, factor: float) -> Any:
  """Decompress: back to the original dtypes, times `factor / scale`."""
  leaves, treedef = jax.tree.flatten(tree16)
  out = [(l.astype(jnp.float32) * (factor / ctx.scale)).astype(d)
         if jnp.issubdtype(d, jnp.floating) else l.astype(d)
         for l, d in zip(leaves, ctx.dtypes)]
  return jax.tree.unflatten(treedef, out)
