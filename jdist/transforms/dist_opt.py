"""`dist_opt`: any optax optimizer, made data-parallel in one call.

It builds the `optax.chain` for each of SINGA DistOpt's update modes:

| mode (SINGA)                   | dist_opt(...)                 | chain                                   |
| ------------------------------ | ----------------------------- | --------------------------------------- |
| backward_and_update            | (default)                     | allreduce, inner                        |
| backward_and_update_half       | half=True / half=jnp.bfloat16 | cast, allreduce, inner                  |
| backward_and_spars_update      | sparsify="topk:0.01"          | topk, [cast], allreduce, inner          |
|   (block-approximate top-K)    | sparsify="topk_block:0.01"    | topk(method="block"), ...               |
|   (threshold)                  | sparsify="threshold:1e-3"     | threshold, [cast], allreduce, inner     |
|   (DGC momentum correction)    | ..., momentum_correction=0.9  | topk(momentum=0.9), ...; inner w/o mom. |
| backward_and_partial_update    | partial=4                     | inner, partial_sync(4)                  |
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import optax

from jdist.collectives import fusion
from jdist.transforms import compress
from jdist.transforms.allreduce import allreduce
from jdist.transforms.partial import partial_sync

SPARSIFY_KINDS = ("topk", "topk_block", "threshold")


def parse_sparsify(sparsify: Any) -> tuple[str, float] | None:
  """Accepts None, ("topk", 0.01), or the CLI form "topk:0.01"."""
  if sparsify is None:
    return None
  if isinstance(sparsify, str):
    kind, _, number = sparsify.partition(":")
    try:
      sparsify = (kind, float(number))
    except ValueError:
      sparsify = (kind, None)
  if (not isinstance(sparsify, (tuple, list)) or len(sparsify) != 2
      or sparsify[0] not in SPARSIFY_KINDS or not isinstance(sparsify[1], (int, float))):
    raise ValueError(
        f"sparsify={sparsify!r} is not understood: use 'topk:RATIO' (e.g. 'topk:0.01'), "
        f"'topk_block:RATIO' (approximate, one pass) or 'threshold:VALUE' (e.g. "
        f"'threshold:0.001'), or a (kind, number) tuple.")
  return sparsify[0], float(sparsify[1])


def _half_dtype(half: Any):
  if half is False or half is None:
    return None
  if half is True:
    return jnp.float16
  return half


def dist_opt(inner: optax.GradientTransformation, *, half: Any = False,
             sparsify: Any = None, partial: int | None = None, mean: bool = True,
             error_feedback: bool = True, threshold_capacity: float | int = 0.05,
             momentum_correction: float = 0.0,
             bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> optax.GradientTransformation:
  """Wraps `inner` so its gradients are averaged over every replica.

  Args:
    inner: any optax optimizer (sgd, adam, ...).
    half: False, True (float16) or a 16-bit dtype: gradients travel in 16 bits.
    sparsify: None, "topk:RATIO", "topk_block:RATIO" or "threshold:VALUE"
      (or a (kind, number) tuple): send only selected entries, with error
      feedback.
    partial: None, or a number of chunks: local updates and one rotating
      chunk of parameters averaged per step (SINGA's partial update).
    mean: average (True) or sum (False) the gradients.
    error_feedback: keep unsent entries for later steps (sparsify only).
    threshold_capacity: most entries sent per step in threshold mode.
    momentum_correction: sparsify only: the momentum, applied locally before
      the selection (Deep Gradient Compression), so `inner` must have none
      (e.g. `optax.sgd(lr)` with `momentum_correction=0.9` in place of
      `optax.sgd(lr, momentum=0.9)`). Recommended for top-K at 1% and below.
    bucket_bytes: tensor-fusion bucket size.

  Returns:
    The chained `optax.GradientTransformation`.

  Raises:
    ValueError: a bad argument, or a combination that makes no sense.
  """
  if not isinstance(inner, optax.GradientTransformation):
    raise ValueError(f"inner={inner!r} is not an optax.GradientTransformation "
                     f"(e.g. optax.sgd(0.01)).")
  dtype = _half_dtype(half)
  sparse = parse_sparsify(sparsify)
  if partial is not None:
    if sparse is not None or dtype is not None:
      raise ValueError(
          "partial=... averages parameters with a full-precision exchange of one chunk; "
          "it does not combine with half=... or sparsify=... (which compress gradients). "
          "Choose one mode.")
    if not mean:
      raise ValueError("partial=... averages parameters; mean=False makes no sense with it.")
    return optax.chain(inner, partial_sync(partial))
  if not error_feedback and sparse is None:
    raise ValueError("error_feedback=False only applies with sparsify=...")
  if momentum_correction and sparse is None:
    raise ValueError(f"momentum_correction={momentum_correction!r} only applies with "
                     f"sparsify=...; use the inner optimizer's momentum instead.")
  steps = []
  if sparse is not None:
    kind, number = sparse
    if kind in ("topk", "topk_block"):
      method = "block" if kind == "topk_block" else "exact"
      steps.append(compress.topk(number, error_feedback, method=method,
                                 momentum=momentum_correction))
    else:
      steps.append(compress.threshold(number, error_feedback, capacity=threshold_capacity,
                                      momentum=momentum_correction))
  if dtype is not None:
    steps.append(compress.cast(dtype))
  steps.append(allreduce(mean, bucket_bytes=bucket_bytes))
  steps.append(inner)
  return optax.chain(*steps)
