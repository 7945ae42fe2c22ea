"""16-bit gradients on the wire: `cast` and its `HalfPayload`.

`cast(dtype)` pre-divides every value by the replica count (Horovod's
predivide; PyTorch's fp16 hook), so sums cannot overflow as replicas grow,
and casts to float16 or bfloat16. The exchange accumulates in float32 where
the wire format allows, and the result comes back in the gradients' own
dtypes. After a compressor (`topk`, `threshold`), `cast` asks that payload to
turn its values to 16 bits (`WirePayload.to_16bit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jdist.collectives.routes.base import HALF_DTYPES
from jdist.compression import protocol
from jdist.runtime import job as job_lib


@dataclasses.dataclass(frozen=True)
class HalfCtx:
  """How a `HalfPayload` turns back into gradients."""
  dtypes: tuple[Any, ...]  # original dtype of each leaf, in leaf order
  scale: float  # leaves were multiplied by `scale` before the cast


@jax.tree_util.register_pytree_node_class
class HalfPayload(protocol.WirePayload):
  """A gradient tree whose leaves travel in 16 bits, pre-scaled."""

  SCHEME = "16-bit"

  def __init__(self, tree: Any, ctx: HalfCtx):
    self.tree = tree
    self.ctx = ctx

  def tree_flatten(self):
    return (self.tree,), self.ctx

  @classmethod
  def tree_unflatten(cls, ctx, children):
    return cls(children[0], ctx)

  def reduce_over_replicas(self, exchange: protocol.Exchange, factor: float) -> Any:
    return from_half(exchange.sum_16bit(self.tree), self.ctx, factor)

  def to_16bit(self, dtype: Any, scale: float) -> "HalfPayload":
    raise ValueError("jdist.cast is applied twice: keep one cast before jdist.allreduce.")

  def __repr__(self):
    return f"HalfPayload({self.tree!r}, scale={self.ctx.scale})"


def to_half(tree: Any, dtype: Any, scale: float) -> HalfPayload:
  """Compress: scale, then cast every floating leaf to the 16-bit `dtype`."""
  leaves, treedef = jax.tree.flatten(tree)
  dtypes = tuple(np.dtype(leaf.dtype) for leaf in leaves)
  cast_leaves = [(leaf * scale).astype(dtype) if jnp.issubdtype(leaf.dtype, jnp.floating)
                 else leaf for leaf in leaves]
  return HalfPayload(jax.tree.unflatten(treedef, cast_leaves), HalfCtx(dtypes, scale))


def from_half(tree16: Any, ctx: HalfCtx, factor: float) -> Any:
  """Decompress: back to the original dtypes, times `factor / scale`."""
  leaves, treedef = jax.tree.flatten(tree16)
  out = [(leaf.astype(jnp.float32) * (factor / ctx.scale)).astype(dtype)
         if jnp.issubdtype(dtype, jnp.floating) else leaf.astype(dtype)
         for leaf, dtype in zip(leaves, ctx.dtypes)]
  return jax.tree.unflatten(treedef, out)


# The names `jdist train --half` and DiLoCo's payload take, and numpy's own.
HALF_NAMES = {"fp16": jnp.float16, "float16": jnp.float16, "bf16": jnp.bfloat16,
              "bfloat16": jnp.bfloat16}


def _check_dtype(dtype, name: str = "dtype") -> np.dtype:
  """`dtype` (a jnp dtype or one of `HALF_NAMES`) as a numpy 16-bit float dtype.

  Raises:
    ValueError: naming the value given as `name=...`, when it is not a 16-bit float.
  """
  given = dtype
  if isinstance(dtype, str):
    dtype = HALF_NAMES.get(dtype.strip().lower())
  try:
    found = None if dtype is None or isinstance(dtype, bool) else np.dtype(dtype)
  except (TypeError, ValueError):
    found = None
  if found not in HALF_DTYPES:
    raise ValueError(f"{name}={given!r} is not a 16-bit float; use jnp.float16 or "
                     f"jnp.bfloat16, or one of the names "
                     f"{', '.join(repr(n) for n in HALF_NAMES)}.")
  return found


def cast(dtype: Any = jnp.float16) -> optax.GradientTransformation:
  """What the next `jdist.allreduce` sends travels in `dtype` (16 bits).

  The reduced gradients come back in their own dtype. Values are divided by
  the replica count before the cast (no overflow as replicas grow) and sums
  are accumulated in float32.

  Args:
    dtype: jnp.float16 or jnp.bfloat16, or a name: "fp16", "bf16",
      "float16", "bfloat16".

  Returns:
    An `optax.GradientTransformation` (stateless).

  Raises:
    ValueError: dtype is not a 16-bit float.
  """
  dtype = _check_dtype(dtype)

  def update_fn(updates, state, params=None):
    del params
    scale = 1.0 / job_lib.current().replica_count
    if isinstance(updates, protocol.WirePayload):
      return updates.to_16bit(dtype, scale), state
    return to_half(updates, dtype, scale), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _half_setting(half: Any):
  """dist_opt's `half`: True is float16; a 16-bit dtype (or its name) is itself."""
  if half is None or half is False:
    return None
  return _check_dtype(jnp.float16 if half is True else half, "half")


SCHEME = protocol.Scheme(
    "half", "encode", _half_setting, lambda dtype, options: cast(dtype),
    combines_with=("sparsify", "diloco"), does="sends gradients as 16-bit floats",
    flag={"choices": ("fp16", "bf16"), "help": "gradients cross replicas as 16-bit floats"},
    mode=lambda half: f"half {half}")
