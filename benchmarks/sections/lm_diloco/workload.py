"""The `lm_diloco` benchmark's corpus (examples/minigpt_single.py's stories and byte tokenizer, cut
into windows), model (its `MiniGPT` in flax linen, no dropout) and steps."""

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

EXAMPLE = os.path.join(jobs.REPO, "examples", "minigpt_single.py")
VALIDATION_SEED = 1  # held-out stories: another seed of the same generator


@functools.cache
def example_definitions(path: str = EXAMPLE) -> dict[str, Any]:
  """`tiny_stories` and `ByteTokenizer` as the example script defines them (only these are
  compiled: the script trains at its module level)."""
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
