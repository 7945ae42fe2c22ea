"""Profile of top-K compression's local work, piece by piece (no communication).

`jdist.topk` spends its time in the step before and after the all-gather.
Here each piece runs alone, jitted, on a flat float32 vector the size of
the compression models (interleaved, medians), so a missed target can be
traced to where the time goes:

  * `abs`: one pass over the vector (the floor of any selection);
  * `topk_update`: the whole `jdist.topk(ratio).update` (ravel, add the
    residual, select, gather, clear the residual), as in the step, and
    `topk_block_update`: the same with `method="block"` (the largest |x| of
    each of k equal blocks: one pass instead of `lax.top_k`);
  * `lax_top_k`: `lax.top_k(|x|, k)`, jdist's selection;
  * `scatter_add`: the receiving side, a dense buffer from 2k (value, index)
    pairs (`zeros.at[idx].add(values)`);
  * other selections: `sampled_threshold` (DGC: the k/100-th largest |x|
    of a 1% strided sample) and `compact_nonzero`
    (`jnp.nonzero(|x| >= t, size=k)`, what a threshold selection needs to
    fill a static-size buffer).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jdist
from benchmarks.harness import timing
from benchmarks.harness import workload

MODELS = ("mlp1m", "mlp10m")
QUICK_MODELS = ("mlp-tiny",)
RATIOS = (0.01, 0.001)
QUICK_PIECES = ("abs", "topk_update", "topk_block_update", "lax_top_k")
SAMPLE_STRIDE = 100  # sampled_threshold looks at every 100th entry


def sampled_threshold(x: jax.Array, k: int) -> jax.Array:
  """DGC's estimate of the k-th largest |x| from a strided 1% sample."""
  sample = jnp.abs(x[::SAMPLE_STRIDE])
  return lax.top_k(sample, max(1, k // SAMPLE_STRIDE))[0][-1]


def pieces(grads, k: int, ratio: float) -> dict:
  """name -> (jitted function, its argument) for one vector size and k."""
  flat = jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)])
  n = flat.shape[0]
  rng = np.random.default_rng(1)
  idx = jnp.asarray(rng.integers(0, n, 2 * k), jnp.int32)
  values = jnp.asarray(rng.standard_normal(2 * k), jnp.float32)
  magnitudes = np.abs(np.asarray(flat))
  threshold = float(np.partition(magnitudes, n - k)[n - k])  # the k-th largest
  exact, block = jdist.topk(ratio), jdist.topk(ratio, method="block")
  state = exact.init(grads)
  return {
      "abs": (jax.jit(jnp.abs), flat),
      "topk_update": (jax.jit(lambda g: exact.update(g, state)[0].indices), grads),
      "topk_block_update": (jax.jit(lambda g: block.update(g, state)[0].indices), grads),
      "lax_top_k": (jax.jit(lambda x: lax.top_k(jnp.abs(x), k)[1]), flat),
      "scatter_add": (jax.jit(lambda v: jnp.zeros((n,), jnp.float32).at[idx].add(v)), values),
      "sampled_threshold": (jax.jit(lambda x: sampled_threshold(x, k)), flat),
      "compact_nonzero": (jax.jit(lambda x: jnp.nonzero(jnp.abs(x) >= threshold, size=k,
                                                        fill_value=0)[0]), flat),
  }


def measure(ctx, name: str, ratio: float) -> list[dict]:
  bench = workload.setup(name, per_replica=1)
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda leaf: jnp.asarray(rng.standard_normal(leaf.shape, np.float32)),
                       jdist.unreplicate(bench.params))
  k = max(1, math.ceil(ratio * bench.param_count))
  calls = {key: (lambda fn=fn, arg=arg: fn(arg)) for key, (fn, arg) in pieces(grads, k, ratio).items()
           if key in QUICK_PIECES or not ctx.quick}
  series = timing.interleaved(calls, repeats=ctx.repeats(9 if k < 50_000 else 5), warmup=1, sync=ctx.sync)
  return [{"model": name, "params": bench.param_count, "ratio": ratio, "k": k, "piece": key,
           **times.as_dict()} for key, times in series.items()]


NAME = "selection"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  for name in QUICK_MODELS if ctx.quick else MODELS:
    for ratio in RATIOS[:1] if ctx.quick else RATIOS:
      yield from measure(ctx, name, ratio)
