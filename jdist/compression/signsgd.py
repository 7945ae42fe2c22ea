"""EF-signSGD: one sign bit per entry and a scale per chunk, with error feedback.

Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes" (ICML 2019); the compressor under DeepSpeed's 1-bit Adam
(Tang et al. 2021). The flattened gradient plus the residual, x, is cut into
chunks of `chunk_size` entries; chunk c travels as its scale
s_c = mean |x| over the chunk (float32) and one bit per entry:

  decoded = s_c * sign(x)        (a zero is sent as +)
  residual = x - decoded         (added to the next step's gradient)

so each chunk keeps its l1 norm and what the signs miss is sent later.

Each process encodes once: its replicas' gradients are averaged first, at
full precision, over the local devices (`jdist.collectives.process_mean`,
XLA's, no bytes across processes), and the error feedback and momentum are
the process's. The signs compress what crosses processes, not what stays
inside one; with one device per process, process and replica are the same.

Bits cannot be summed on the wire, so the payload is an all-gather of every
process's bytes, [signs (8 per byte) | scales (float32)], decoded and summed
in float32 after it (`Exchange.gather_per_process`: each local device sends
1/D of them): 1/8 + 4/chunk_size bytes per entry and process (0.133 at 512)
against 4 for the dense float32 all-reduce, 1/30 of its bytes across 2
processes whatever their device count. Like QSGD's, the gathered bytes grow
with the process count: (P - 1) * n * (1/8 + 4/chunk_size) per process
across P processes, against 2(P - 1)/P * 4n dense.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdist import collectives
from jdist import fusion
from jdist.compression import protocol

BITS_PER_BYTE = 8


@dataclasses.dataclass(frozen=True)
class SignCtx:
  """How a `SignPayload` turns back into a gradient tree."""
  spec: fusion.FlatSpec  # the dense tree, as one flat vector
  chunk_size: int


@jax.tree_util.register_pytree_node_class
class SignPayload(protocol.WirePayload):
  """Signs packed 8 per byte, `bits` uint8 [chunks * chunk_size / 8], and `scales` float32 [chunks]."""

  SCHEME = "EF-signSGD"

  def __init__(self, bits: jax.Array, scales: jax.Array, ctx: SignCtx):
    self.bits = bits
    self.scales = scales
    self.ctx = ctx

  def tree_flatten(self):
    return (self.bits, self.scales), self.ctx

  @classmethod
  def tree_unflatten(cls, ctx, children):
    return cls(children[0], children[1], ctx)

  def reduce_over_replicas(self, exchange: protocol.Exchange, factor: float) -> Any:
    """All-gathers every process's [signs | scales] bytes; decodes and sums in float32.

    Each process's payload encodes the mean of its replicas, so the sum over
    processes counts each replica's share replicas / processes times.
    """
    chunks, width = self.scales.shape[0], self.bits.shape[0]
    wire = jnp.concatenate([self.bits,
                            lax.bitcast_convert_type(self.scales, jnp.uint8).reshape(-1)])
    everyone = exchange.gather_per_process(wire)  # [P, width + 4 * chunks]
    scales = lax.bitcast_convert_type(everyone[:, width:].reshape(-1, chunks, 4), jnp.float32)
    decoded = decode(everyone[:, :width], scales, self.ctx.chunk_size)
    per_process = factor * exchange.replicas / exchange.processes
    return fusion.unravel(decoded.sum(0)[:self.ctx.spec.size] * per_process, self.ctx.spec)

  def __repr__(self):
    return (f"SignPayload(n={self.ctx.spec.size}, chunks={self.scales.shape[0]}, "
            f"chunk_size={self.ctx.chunk_size})")


def encode(x: jax.Array, chunk_size: int) -> tuple[jax.Array, jax.Array]:
  """(signs uint8 [x.size / 8], scales float32 [chunks]) of a flat float32 x of whole chunks."""
  rows = x.reshape(-1, chunk_size)
  return jnp.packbits(rows.reshape(-1) >= 0), jnp.mean(jnp.abs(rows), axis=1)


def decode(bits: jax.Array, scales: jax.Array, chunk_size: int) -> jax.Array:
  """The float32 values of packed signs [..., n / 8] and their chunks' `scales` [..., chunks]."""
  positive = jnp.unpackbits(bits, axis=-1).reshape(scales.shape + (chunk_size,))
  values = jnp.where(positive == 1, 1.0, -1.0) * scales[..., None]
  return values.reshape(scales.shape[:-1] + (-1,))


class SignSGDState(NamedTuple):
  """State of `signsgd`.

  Attributes:
    residual: what the signs missed so far, flattened and padded to whole
      chunks (float32; empty without error feedback).
    momentum: the local momentum the signs encode, flattened and padded
      (float32; empty without `momentum`).
  """
  residual: jax.Array
  momentum: jax.Array


def signsgd(chunk_size: int = 512, *, error_feedback: bool = True,
            momentum: float = 0.0) -> optax.GradientTransformation:
  """Gradients cross processes as one sign bit per entry and a scale per chunk (EF-signSGD).

  Each process encodes the mean of its replicas' gradients once (module doc).

  Put it before `jdist.allreduce`:
  `optax.chain(signsgd(), jdist.allreduce(), optax.sgd(lr, momentum=0.9))`,
  or use `jdist.dist_opt(inner, signsgd=True)` (`jdist train --signsgd`).

  Args:
    chunk_size: entries sharing one float32 scale (a multiple of 8); the
      wire carries 1/8 + 4/chunk_size bytes per entry.
    error_feedback: add what the signs missed to the next step's gradient
      (without it, scaled signs are biased and training stalls sooner).
    momentum: if above 0, each process keeps a heavy-ball momentum of its
      replicas' mean gradient and the signs encode it (as 1-bit Adam compresses its
      momentum); the inner optimizer then has none. Measured on the main
      job: signs of the gradient under an SGD momentum of 0.9 after the
      exchange end at 81.94%, signs of the momentum at 96.39% (plain 97.22%).

  Returns:
    An `optax.GradientTransformation` with a `SignSGDState`, emitting a
    `SignPayload` for `jdist.allreduce`.

  Raises:
    ValueError: a chunk size that is not a positive multiple of 8, a flag
      that is not a bool, or a momentum outside [0, 1).
  """
  if (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 8
      or chunk_size % BITS_PER_BYTE):
    raise ValueError(f"chunk_size={chunk_size!r} must be a positive multiple of 8 (e.g. 512): "
                     f"each chunk's signs fill whole bytes.")
  if not isinstance(error_feedback, bool):
    raise ValueError(f"error_feedback={error_feedback!r} must be True or False.")
  if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
    raise ValueError(f"momentum={momentum!r} must be a number in [0, 1) (e.g. 0.9).")

  def padded_size(params):
    return -(-fusion.flat_spec(params).size // chunk_size) * chunk_size

  def init_fn(params):
    size = padded_size(params)
    return SignSGDState(jnp.zeros((size if error_feedback else 0,), jnp.float32),
                        jnp.zeros((size if momentum else 0,), jnp.float32))

  def update_fn(updates, state, params=None):
    del params
    if isinstance(updates, protocol.WirePayload):
      raise ValueError("jdist's signsgd encodes the dense gradient: put no jdist.cast, "
                       "jdist.topk or jdist.threshold before it.")
    spec = fusion.flat_spec(updates)
    x = collectives.process_mean(fusion.ravel(updates, jnp.float32))  # one encoding per process
    x = jnp.pad(x, (0, padded_size(updates) - spec.size))
    velocity = momentum * state.momentum + x if momentum else state.momentum
    x = velocity if momentum else x
    if error_feedback:
      x = x + state.residual
    bits, scales = encode(x, chunk_size)
    residual = x - decode(bits, scales, chunk_size) if error_feedback else state.residual
    return SignPayload(bits, scales, SignCtx(spec, chunk_size)), SignSGDState(residual, velocity)

  return optax.GradientTransformation(init_fn, update_fn)


SCHEME = protocol.Scheme(
    "signsgd", "encode", protocol.enabled,
    lambda setting, o: signsgd(512 if setting is True else setting,
                               error_feedback=o.error_feedback, momentum=o.momentum_correction),
    options=("error_feedback", "momentum_correction"), local_momentum=True,
    does="sends gradients as 1-bit signs (EF-signSGD)",
    flag={"action": "store_true", "help": "EF-signSGD: gradients cross replicas as one sign "
          "bit per entry and a float32 scale (mean magnitude) per 512 entries, with error "
          "feedback, once per process; an SGD momentum moves before the signs (1/30 of the dense "
          "bytes across 2 processes)"},
    mode=lambda setting: "signsgd 1-bit with error feedback")
