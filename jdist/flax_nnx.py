"""Flax NNX pieces that need the replicas: a synchronized BatchNorm.

With `nnx.Optimizer(model, jdist.dist_opt(...), wrt=nnx.Param)` an NNX model
trains data-parallel as it is, in a `jdist.data_parallel` step or a jit step
over global arrays (see `examples/nnx_mnist.py`). What still depends on the
replicas is batch normalization: `nnx.BatchNorm` normalizes with the moments
of the batch it sees (one replica's, or one process's in a jit step), so
replicas drift apart in their running statistics. `SyncBatchNorm` takes the
moments over every replica of the job instead, as one device would on the
whole global batch.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax import lax

from jdist.collectives import ops


class SyncBatchNorm(nnx.Module):
  """BatchNorm over the feature axis whose batch moments span every replica.

  A drop-in for `nnx.BatchNorm(num_features, ...)` with its defaults
  (momentum 0.99, epsilon 1e-5, scale and bias, variance as E[x^2] -
  E[x]^2). In training mode the per-replica means of x and x^2 are averaged
  with `jdist.pmean` (replicas hold equal batches), so every replica
  normalizes with the global batch's moments and keeps identical running
  statistics. `model.train()` / `model.eval()` switch it like BatchNorm.
  Training differentiates through that `jdist.pmean` (in every topology and
  both step styles): the replicas' gradients, averaged as `jdist.dist_opt`
  does, are one device's gradients on the whole batch.

  Args:
    num_features: size of the last axis.
    use_running_average: normalize with the running statistics (evaluation).
    momentum: decay of the running statistics.
    epsilon: added to the variance.
    rngs: unused; accepted for BatchNorm's signature.
  """

  def __init__(self, num_features: int, *, use_running_average: bool = False,
               momentum: float = 0.99, epsilon: float = 1e-5, rngs: nnx.Rngs | None = None):
    del rngs
    self.scale = nnx.Param(jnp.ones((num_features,), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((num_features,), jnp.float32))
    self.mean = nnx.BatchStat(jnp.zeros((num_features,), jnp.float32))
    self.var = nnx.BatchStat(jnp.ones((num_features,), jnp.float32))
    self.use_running_average = use_running_average
    self.momentum, self.epsilon = momentum, epsilon

  def __call__(self, x, use_running_average: bool | None = None):
    running = self.use_running_average if use_running_average is None else use_running_average
    if running:
      mean, var = self.mean[...], self.var[...]
    else:
      axes = tuple(range(x.ndim - 1))
      moments = jnp.stack([jnp.mean(x, axes), jnp.mean(jnp.square(x), axes)]).astype(jnp.float32)
      mean, mean_square = ops.pmean(moments)
      var = jnp.maximum(mean_square - jnp.square(mean), 0.0)
      self.mean[...] = lax.stop_gradient(self.momentum * self.mean[...]
                                         + (1 - self.momentum) * mean)
      self.var[...] = lax.stop_gradient(self.momentum * self.var[...]
                                        + (1 - self.momentum) * var)
    normalized = (x - mean) * lax.rsqrt(var + self.epsilon)
    return (normalized * self.scale[...] + self.bias[...]).astype(x.dtype)
