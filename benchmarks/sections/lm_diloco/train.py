"""Worker measurement "lm_diloco": one variant of examples/minigpt_single.py's miniGPT (flax
linen, no dropout) trained for a number of tokens of its stories (docs/diloco.md).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import os
import random
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from benchmarks.harness import jobs
from benchmarks.harness import workload
from benchmarks.sections import accuracy
from benchmarks.sections.time_to_accuracy import train as train_to_target
from jdist.runtime import host

EXAMPLE = os.path.join(jobs.REPO, "examples", "minigpt_single.py")
VALIDATION_SEED = 1  # held-out stories: another seed of the same generator


@functools.cache
def example_definitions(path: str = EXAMPLE) -> dict[str, Any]:
  """`tiny_stories` and `ByteTokenizer` from the example's source."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  wanted = {"tiny_stories", "ByteTokenizer"}
  nodes = [n for n in tree.body if getattr(n, "name", None) in wanted]
  if {n.name for n in nodes} != wanted:
    raise ValueError(f"{path} no longer defines {sorted(wanted)} at its top level.")
  namespace: dict[str, Any] = {"random": random}
  exec(compile(ast.Module(body=nodes, type_ignores=[]), path, "exec"), namespace)  # pylint: disable=exec-used
  return {name: namespace[name] for name in wanted}


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Token windows `[N, seq + 1]` (int32) for training and validation."""
  train: np.ndarray
  validation: np.ndarray
  vocab_size: int
  train_tokens: int  # tokens in the training stream


def windows(tokens: list[int], seq: int) -> np.ndarray:
  """The stream cut into consecutive windows of `seq + 1` tokens (the tail dropped)."""
  count = len(tokens) // (seq + 1)
  return np.asarray(tokens[:count * (seq + 1)], np.int32).reshape(count, seq + 1)


def load_corpus(stories: int, validation_stories: int, seq: int) -> Corpus:
  """The example's generated stories as training and held-out validation windows."""
  defs = example_definitions()
  tokenizer = defs["ByteTokenizer"]()
  special = {tokenizer.eot}
  train = tokenizer.encode(defs["tiny_stories"](stories, seed=0), allowed_special=special)
  held_out = tokenizer.encode(defs["tiny_stories"](validation_stories, seed=VALIDATION_SEED),
                              allowed_special=special)
  return Corpus(windows(train, seq), windows(held_out, seq), tokenizer.n_vocab, len(train))


class Block(nn.Module):
  """Causal self-attention and a ReLU feed-forward layer, each followed by LayerNorm."""
  heads: int
  ff_dim: int

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    attended = nn.MultiHeadDotProductAttention(num_heads=self.heads,
                                               kernel_init=nn.initializers.xavier_uniform())(
                                                   x, x, mask=mask)
    x = nn.LayerNorm(epsilon=1e-6)(x + attended)
    hidden = nn.relu(nn.Dense(self.ff_dim, kernel_init=nn.initializers.xavier_uniform())(x))
    out = nn.Dense(x.shape[-1], kernel_init=nn.initializers.xavier_uniform())(hidden)
    return nn.LayerNorm(epsilon=1e-6)(x + out)


class MiniGPT(nn.Module):
  """The miniGPT tutorial's transformer: tokens `[B, T]` -> logits `[B, T, vocab]`."""
  vocab_size: int
  maxlen: int
  embed_dim: int = 64
  heads: int = 4
  ff_dim: int = 256
  blocks: int = 2

  @nn.compact
  def __call__(self, tokens):
    x = (nn.Embed(self.vocab_size, self.embed_dim)(tokens)
         + nn.Embed(self.maxlen, self.embed_dim)(jnp.arange(tokens.shape[1])[None]))
    for _ in range(self.blocks):
      x = Block(self.heads, self.ff_dim)(x)
    return nn.Dense(self.vocab_size, kernel_init=nn.initializers.xavier_uniform())(x)


def build_model(corpus: Corpus, seq: int, embed_dim: int, blocks: int, seed: int = 0):
  """The model and its initial parameters (the same for a seed)."""
  model = MiniGPT(corpus.vocab_size, seq, embed_dim=embed_dim, heads=4, ff_dim=4 * embed_dim,
                  blocks=blocks)
  params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, seq), jnp.int32))["params"]
  return model, params


def loss(model: nn.Module, params, windows_: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats per token) over windows `[B, seq + 1]`."""
  logits = model.apply({"params": params}, windows_[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, windows_[:, 1:]).mean()


def train_step(model: nn.Module, tx: optax.GradientTransformation):
  """`(params, opt_state, windows) -> (params, opt_state, loss)`, data-parallel."""

  @jdist.data_parallel
  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(functools.partial(loss, model))(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jdist.pmean(value)

  return step


def make_validate(model: nn.Module, validation: np.ndarray, batch: int = 64):
  """Validation loss of (unreplicated) parameters: the mean over every held-out window."""
  total = jax.jit(lambda params, w: loss(model, params, w) * w.shape[0])

  def validate(params) -> float:
    summed = sum(float(total(params, validation[i:i + batch]))
                 for i in range(0, len(validation), batch))
    return summed / len(validation)

  return validate


# Every mode of benchmarks.sections.accuracy but DGC's momentum correction (SGD's momentum).
VARIANTS = tuple(m for m in accuracy.MODES if "momentum_correction" not in accuracy.MODES[m])
DEFAULTS = {"tokens": 2 ** 20, "batch": 16, "seq": 64, "embed": 64, "blocks": 2, "lr": 1e-3,
            "stories": 8000, "validation_stories": 300, "eval_every": 64}

# run_to_target's fields about a test accuracy and its target, which this section has not.
TARGET_FIELDS = ("test_accuracy", "final_accuracy", "epoch", "epochs_trained",
                 "completed_all_epochs", "stopped_at_target", "reached_step", "epochs_to_target",
                 "time_to_target_s")


def transformation(variant: str, lr: float) -> optax.GradientTransformation:
  """`jdist.dist_opt(optax.adamw(lr), **accuracy.MODES[variant])`."""
  if variant not in VARIANTS:
    raise ValueError(f"Unknown variant {variant!r}: choose from {list(VARIANTS)}.")
  return jdist.dist_opt(optax.adamw(lr), **accuracy.MODES[variant])


def steps_for(tokens: int, replicas: int, batch: int, seq: int) -> int:
  """Steps that train on `tokens` tokens (at least one): each step takes replicas x batch x seq."""
  return max(1, tokens // (replicas * batch * seq))


class LanguageModelTrainer(train_to_target.JdistTrainer):
  """A jdist mode's run on the language model: `step(indices)` trains on windows."""

  def __init__(self, variant: str, model, params: Any, corpus: Corpus, replicas,
               lr: float):  # pylint: disable=super-init-not-called
    tx = transformation(variant, lr)
    self.start(variant, tx, train_step(model, tx), params, replicas)
    self.corpus = corpus
    self.validate = make_validate(model, corpus.validation)

  def inputs(self, rows) -> tuple:
    return (workload.shard(self.corpus.train[rows]),)

  def evaluate(self) -> float:
    return self.validate(self.test_params)

  def warm_up(self, indices) -> None:
    """Compiles the step: one step on `indices` whose results are dropped (no step counted)."""
    jax.block_until_ready(self.train_step(self.params, self.opt_state,
                                          *self.inputs(indices[self.replicas])))


def batches(corpus: Corpus, replicas: int, batch: int, steps: int):
  """Every step's window indices `[replicas, batch]`, over as many epochs as it takes."""
  epoch = 0
  while steps > 0:
    order = accuracy.epoch_batches(len(corpus.train), replicas, batch, epoch)[:steps]
    yield from order
    steps -= len(order)
    epoch += 1


NAME = "lm_diloco"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  """The section: the variant of `ctx.options` trained for its tokens, row by row."""
  options = dict(DEFAULTS, **ctx.options)
  variant = options["variant"]
  batch, seq = int(options["batch"]), int(options["seq"])
  corpus = load_corpus(int(options["stories"]), int(options["validation_stories"]),
                                   seq)
  model, params = build_model(corpus, seq, int(options["embed"]),
                                          int(options["blocks"]))
  replicas = ctx.topo.replica_count
  steps = steps_for(int(options["tokens"]), replicas, batch, seq)
  tokens_per_step = replicas * batch * seq
  schedule = train_to_target.Schedule(
      epochs=1, steps_per_epoch=steps, eval_every=int(options["eval_every"]) or steps,
      target=float("inf"), stop_at_target=False,
      max_seconds=float(options.get("max_seconds") or 0.0))
  trainer = LanguageModelTrainer(variant, model, params, corpus, ctx.topo.replica_indices,
                                 float(options["lr"]))
  trainer.warm_up(next(batches(corpus, replicas, batch, 1)))
  ctx.sync()
  rows = train_to_target.run_to_target(
      trainer, schedule, lambda _: batches(corpus, replicas, batch, steps),
      is_root=ctx.rank == 0,
      share=lambda value: host.allgather_object(value, "lm_diloco validation loss")[0])
  for point in rows:  # run_to_target keeps its curve's rows: copies are changed here
    row = {k: v for k, v in point.items() if k not in TARGET_FIELDS}
    row.update(variant=variant, val_loss=point.get("test_accuracy", point.get("final_accuracy")),
               tokens=point.get("step", point.get("steps")) * tokens_per_step)
    if row["kind"] == "final":
      row.update(steps_planned=steps, tokens_per_step=tokens_per_step, replicas=replicas,
                 batch_per_replica=batch, seq=seq, embed=int(options["embed"]),
                 blocks=int(options["blocks"]), lr=float(options["lr"]),
                 parameters=sum(int(p.size) for p in jax.tree.leaves(params)),
                 train_windows=len(corpus.train), validation_windows=len(corpus.validation),
                 train_tokens=corpus.train_tokens, eval_every=schedule.eval_every)
    yield row
