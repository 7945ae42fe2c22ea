"""The two step styles, timed against each other: a jit step over global arrays / `data_parallel`.

  bash scripts/mpirun.sh -np 2 -x XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
      python -m benchmarks styles [--repeats 40] [--global-batch 64] [--models cnn,transformer]

SINGA's CNN and a small transformer classifier, both ways on one global batch, interleaved
step by step; one JSON row per model (docs/topologies.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from benchmarks.harness import timing
from benchmarks.harness import workload
from benchmarks.harness.section import Run, section
from jdist.app import models

SEQUENCE, EMBED, HEADS, BLOCKS, VOCAB = 64, 64, 4, 2, 256
LEARNING_RATE = 0.01


class _Block(nn.Module):
  """Pre-norm self-attention and MLP, each with a residual."""

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(nn.LayerNorm()(x))
    h = nn.Dense(4 * EMBED)(nn.LayerNorm()(x))
    return x + nn.Dense(EMBED)(nn.gelu(h))


class SmallTransformer(nn.Module):
  """Token classifier: embedding + positions, `BLOCKS` blocks, mean pool, dense."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, EMBED)(tokens)
    x = x + self.param("positions", nn.initializers.normal(0.02), (SEQUENCE, EMBED))
    for _ in range(BLOCKS):
      x = _Block()(x)
    return nn.Dense(workload.NUM_CLASSES)(nn.LayerNorm()(x).mean(axis=1))


def _model_and_batch(name: str, global_batch: int, seed: int = 0):
  """The model, its parameters and a global batch (host arrays, the same on every rank)."""
  rng = np.random.default_rng(seed)
  y = rng.integers(0, workload.NUM_CLASSES, size=(global_batch,)).astype(np.int32)
  if name == "transformer":
    model = SmallTransformer()
    x = rng.integers(0, VOCAB, size=(global_batch, SEQUENCE)).astype(np.int32)
  else:
    model = workload.build(name)
    x = rng.random((global_batch,) + workload.IMAGE_SHAPE, dtype=np.float32)
  params = jax.jit(model.init)(jax.random.key(seed), jnp.asarray(x[:1]))["params"]
  return model, params, x, y


def measure(name: str, global_batch: int, repeats: int, warmup: int = 3) -> dict[str, Any]:
  """Interleaved jit and data_parallel steps of model `name` on one global batch."""
  topo = jdist.init()
  if global_batch % topo.replica_count:
    raise ValueError(f"--global-batch {global_batch} must be a multiple of the "
                     f"{topo.replica_count} replicas.")
  model, params, x, y = _model_and_batch(name, global_batch)
  tx = jdist.dist_opt(optax.sgd(LEARNING_RATE))
  with jax.set_mesh(jdist.mesh()):
    placed = workload.style_setup(model, params, x, y)
    variants = {style: placed.stepper(style, tx) for style in workload.STYLES}
    series = timing.interleaved(variants, repeats=repeats, warmup=warmup, sync=jdist.barrier)
  jit, dp = series["jit"], series["data_parallel"]
  return {"model": name, "params": models.param_count(params), "global_batch": global_batch,
          "processes": topo.process_count, "devices": topo.local_device_count,
          "route": topo.route,
          "jit_route": topo.jit_route, "repeats": repeats,
          **jit.as_dict("jit_"), **dp.as_dict("data_parallel_"),
          "ratio_of_medians": jit.median / dp.median,
          "paired_ratio": timing.paired_ratio(jit, dp),
          "load_average": os.getloadavg()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--models", default="cnn,transformer")
  parser.add_argument("--global-batch", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=40)
  parser.add_argument("--out", default=None, help="append JSON lines here (rank 0)")


def main(args: argparse.Namespace) -> int:
  topo = jdist.init()
  for name in args.models.split(","):
    row = measure(name, args.global_batch, args.repeats)
    if topo.is_primary:
      line = json.dumps(row)
      print(line, flush=True)
      if args.out:
        with open(args.out, "a", encoding="utf-8") as out:
          out.write(line + "\n")


SECTION = section("styles", "a jit step over global arrays against data_parallel",
                  mpirun=Run.of(sys.modules[__name__]))
