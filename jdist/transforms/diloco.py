"""DiLoCo and Streaming DiLoCo: local inner steps, an outer step every H.

DiLoCo (Douillard et al., arXiv 2311.08105): every replica takes `sync_every`
(H) steps of the inner optimizer on its own gradients, with its own inner
state. Then the *pseudo-gradient* `outer_params - local_params` is averaged
over every replica, an outer optimizer (SGD with Nesterov momentum, lr 0.7)
moves the shared outer parameters by it, and every replica's local
parameters start again from the new outer ones. Parameters cross replicas
once every H steps instead of gradients every step.

Streaming DiLoCo (arXiv 2501.18512), `fragments=P`: the parameters are cut
into P fragments of whole leaves (balanced by size); fragment p has its own
outer step, at the inner steps s with `s % H == offset_p`, the offsets
staggered by H/P, so one fragment's bytes cross per sync and each fragment
still syncs once every H steps. `delay=τ`: the averaged pseudo-gradient of
a fragment, exchanged at step s, is applied at step s + τ; on the native
route (float32 or sparse payload, `jdist.data_parallel` step) the exchange
runs in the background meanwhile (`jdist.transforms.diloco_background`),
elsewhere inside step s, the state holding the average. On applying, the fragment's
local parameters become `mix * local + (1 - mix) * outer` (0 replaces them).

`payload` sets what a pseudo-gradient is sent as: float32, 16-bit floats
(`jdist.cast`'s codec, summed in float32), or 8-bit / 4-bit levels with one
float32 scale per block of `PAYLOAD_BLOCK` values (`jdist.qsgd`'s codec,
rounded to the nearest level; 4-bit levels travel two per byte,
`jdist.compression.pack4`). Levels cannot be summed on the wire, so every
replica's [levels | scales] bytes are all-gathered, then decoded and
averaged in float32. With 8 and 4 bits, error feedback (as in Streaming
DiLoCo, OpenDiLoCo and INTELLECT-1): what a replica's encoding missed
(`DiLoCoState.residual`, per leaf) is added to that fragment's next
pseudo-gradient, so the error does not build up over the outer steps.
"sparse" (SparseLoCo, arXiv 2508.15706; `jdist.compression.sparseloco`)
sends the top `ratio` of each chunk of the fragment's pseudo-gradient (plus
residual) as uint16 offsets and 2-bit codes (sign and magnitude bit) with
two float32 scales per chunk, all-gathered like the levels; what was not
sent, or sent inexactly, stays in the same residual.

Steps are counted by the state, the same on every replica, so every replica
takes the same branch of the `lax.switch` that holds a fragment's exchange:
only sync steps send bytes (`DiLoCoState.wire_bytes`, by the collective
layer's ledger).

The updates returned move `params` to the new local parameters (on a
fragment's apply step, to its merged outer parameters):
`optax.apply_updates(params, updates)`, as with any optax optimizer. Other
leaves get the inner optimizer's updates unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jdist import collectives
from jdist.collectives.routes.base import HALF_DTYPES
from jdist import fusion
from jdist.compression import half as half_lib
from jdist.compression import protocol
from jdist.compression import qsgd as qsgd_lib
from jdist.compression import sparseloco
from jdist.runtime import job as job_lib
from jdist.transforms import diloco_background as background

PAYLOADS = {"fp16": jnp.float16, "bf16": jnp.bfloat16}
QUANTIZED = {"int8": 8, "int4": 4}  # payload -> bits per value on the wire
PAYLOAD_CHOICES = ("float32", "bf16", "fp16", "int8", "int4", "sparse")
SPARSE = "sparse"  # "sparse" or "sparse:RATIO": `SparseCodec`
# Values sharing one float32 scale in the 8- and 4-bit payloads: 4 bytes of
# scale per 256 values add 1/64 byte per value (3% over int4's half byte).
PAYLOAD_BLOCK = 256


@protocol.register_wire_state
class DiLoCoState(NamedTuple):
  """State of `diloco`: a pytree of arrays (checkpointable as it is).

  Attributes:
    step: inner steps taken (the same on every replica).
    inner_state: the inner optimizer's state, this replica's own.
    outer_params: the shared outer parameters (equal on every replica).
    outer_states: the outer optimizer's state, one per fragment.
    pending: with `delay > 0`, averaged pseudo-gradients exchanged and not
      yet applied (a fragment's leaves hold its latest); else ().
    syncs: outer syncs so far (fragment exchanges).
    wire_bytes: bytes this process sent across processes in the last step.
    residual: with an 8-/4-bit or sparse payload, per leaf (float32, shaped like
      the parameters), what this replica's last encoding of its fragment's
      pseudo-gradient missed: added to the next one (error feedback); else ().
    in_flight: with `delay > 0`, int32 [fragments, 3]: each fragment's
      exchange running in the background (`diloco_background`; its `pending`
      leaves then hold this replica's share), zeros if none; else ().
  """
  step: jax.Array
  inner_state: Any
  outer_params: Any
  outer_states: tuple
  pending: Any
  syncs: jax.Array
  wire_bytes: jax.Array
  residual: Any = ()
  in_flight: Any = ()


def fragment_plan(sizes: list[int], fragments: int) -> list[list[int]]:
  """Leaves of each fragment: whole leaves, the largest first to the lightest fragment.

  Returns:
    Per fragment, the indices of its leaves in leaf order.

  Raises:
    ValueError: fewer leaves than fragments.
  """
  if fragments > len(sizes):
    raise ValueError(f"fragments={fragments} is more than the {len(sizes)} parameter "
                     f"leaves: fragments are made of whole leaves.")
  loads, plan = [0] * fragments, [[] for _ in range(fragments)]
  for leaf in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    lightest = min(range(fragments), key=lambda f: (loads[f], f))
    plan[lightest].append(leaf)
    loads[lightest] += sizes[leaf]
  return [sorted(leaves) for leaves in plan]


def sync_offsets(sync_every: int, fragments: int) -> list[int]:
  """Fragment p syncs after the inner steps s (from 1) with `s % sync_every == offsets[p]`.

  The last fragment syncs at H, 2H, ...; the others H/P, 2H/P, ... before.
  """
  return [(p + 1) * sync_every // fragments % sync_every for p in range(fragments)]


def due(step: jax.Array, offsets: list[int], sync_every: int) -> jax.Array:
  """0 where no fragment is due at `step` (counted from 1), else 1 + its index."""
  hits = jnp.asarray(offsets, jnp.int32) == step % sync_every
  return jnp.where(jnp.any(hits) & (step >= 1), jnp.argmax(hits).astype(jnp.int32) + 1, 0)


def check_int(name: str, value: Any, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an int >= {minimum}.")


def check_inner(inner: Any) -> None:
  if not isinstance(inner, optax.GradientTransformation):
    raise ValueError(f"inner={inner!r} is not an optax.GradientTransformation "
                     f"(e.g. optax.adamw(1e-3)).")


@dataclasses.dataclass(frozen=True)
class SparseCodec:
  """`payload="sparse[:RATIO]"`: the top `ratio` of each chunk in 2 bits (SparseLoCo)."""
  ratio: float = sparseloco.DEFAULT_RATIO


def sparse_codec(payload: str) -> SparseCodec:
  """The `SparseCodec` of "sparse" or "sparse:RATIO" (e.g. "sparse:0.01").

  Raises:
    ValueError: a ratio that is not a number in (0, 1], naming the payload.
  """
  _, colon, text = payload.partition(":")
  if not colon:
    return SparseCodec()
  try:
    return SparseCodec(sparseloco.check_ratio(float(text)))
  except ValueError:
    raise ValueError(f"payload={payload!r}: the ratio {text!r} must be a number in (0, 1], "
                     f"the fraction of each chunk sent (e.g. 'sparse:0.02').") from None


def feeds_back(codec: Any) -> bool:
  """Whether a codec keeps an error-feedback residual: 8/4 bits and sparse."""
  return isinstance(codec, (int, SparseCodec))


def payload_codec(payload: Any):
  """What a payload setting sends: None (float32), a 16-bit dtype, 8 or 4 (bits),
  or a `SparseCodec`.

  Raises:
    ValueError: anything else, listing the allowed values.
  """
  if payload is None or payload == "float32":
    return None
  if isinstance(payload, str) and payload in QUANTIZED:
    return QUANTIZED[payload]
  if isinstance(payload, str) and payload.partition(":")[0] == SPARSE:
    return sparse_codec(payload)
  dtype = PAYLOADS.get(payload, payload) if isinstance(payload, str) else payload
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in HALF_DTYPES:
    raise ValueError(f"payload={payload!r} must be None or one of "
                     f"{', '.join(repr(name) for name in PAYLOAD_CHOICES)} "
                     f"(or jnp.float16, jnp.bfloat16, or 'sparse:RATIO').")
  return dtype


def choose_payload(half: Any, payload: Any) -> Any:
  """`jdist.dist_opt`'s diloco payload: `diloco_payload`, else `half`'s 16-bit dtype.

  Raises:
    ValueError: both are set.
  """
  if payload is not None and half is not None:
    raise ValueError(f"diloco_payload={payload!r} and half={half!r} both set DiLoCo's "
                     f"payload: keep one (e.g. only diloco_payload='bf16').")
  return half if payload is None else payload


def replica_mean(tree: Any, codec) -> Any:
  """Mean over every replica, in full precision or through jdist's 16-bit codec."""
  if codec is None:
    return collectives.reduce_payload(tree, mean=True)
  scale = 1.0 / job_lib.current().replica_count
  return collectives.reduce_payload(half_lib.to_half(tree, codec, scale), mean=True)


def encode(x: jax.Array, spec: fusion.FlatSpec, codec: Any) -> tuple[Any, jax.Array]:
  """(the payload of a flat float32 `x` for `codec`, 8/4 bits or sparse;
  what every replica decodes of it, float32 [n])."""
  if isinstance(codec, SparseCodec):
    return sparseloco.encode(x, spec, codec.ratio)
  levels, scales = qsgd_lib.quantize(x, None, PAYLOAD_BLOCK, qsgd_lib.max_level(codec))
  sent = qsgd_lib.dequantize(levels, scales, PAYLOAD_BLOCK, qsgd_lib.max_level(codec))
  payload = qsgd_lib.QSGDPayload(levels, scales, qsgd_lib.QSGDCtx(spec, PAYLOAD_BLOCK, codec))
  return payload, sent[:x.shape[0]]


def encoded_mean(leaves: list[jax.Array], residual: list[jax.Array],
                 codec: Any) -> tuple[list[jax.Array], list[jax.Array]]:
  """Mean over every replica of `leaves` + `residual`, sent as `codec` says
  (8-/4-bit levels or sparse, `encode`).

  Returns:
    (the decoded mean, leaves in their dtypes; the new residual, float32:
    this replica's value minus what the others decode of it).
  """
  spec = fusion.flat_spec(leaves)
  x = fusion.ravel(leaves, jnp.float32) + fusion.ravel(residual, jnp.float32)
  payload, sent = encode(x, spec, codec)
  return (collectives.reduce_payload(payload, mean=True),
          fusion.unravel(x - sent, fusion.flat_spec(residual)))


def check_arguments(inner: Any, sync_every: Any, outer: Any, fragments: Any, delay: Any,
                    mix: Any) -> optax.GradientTransformation:
  """`diloco`'s checks of its arguments; returns the outer optimizer (the default if None).

  Raises:
    ValueError: a bad argument, naming it.
  """
  check_inner(inner)
  check_int("sync_every", sync_every, 1)
  check_int("fragments", fragments, 1)
  check_int("delay", delay, 0)
  if outer is None:
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  elif not isinstance(outer, optax.GradientTransformation):
    raise ValueError(f"outer={outer!r} is not an optax.GradientTransformation.")
  if fragments > sync_every:
    raise ValueError(f"fragments={fragments} must be <= sync_every={sync_every}: each "
                     f"fragment syncs on a step of its own within every H steps.")
  if delay >= sync_every:
    raise ValueError(f"delay={delay} must be < sync_every={sync_every}: a fragment's "
                     f"outer step lands before its next exchange.")
  if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0.0 <= mix < 1.0:
    raise ValueError(f"mix={mix!r} must be a number in [0, 1).")
  return outer


class _Fragments:
  """A fragment's exchange and outer step, for one traced `update` (leaf lists).

  Attributes:
    plan: per fragment, the indices of its leaves.
    sent: bytes each `lax.switch` branch sends (0: no fragment due), filled
      in as the branches are traced.
  """

  def __init__(self, outer: optax.GradientTransformation, plan: list[list[int]], codec: Any,
               mix: float):
    self.outer, self.plan, self.codec, self.mix = outer, plan, codec, mix
    self.sent = [0] * (len(plan) + 1)

  def pseudo_gradient(self, p, updates, params, outer_now) -> list:
    """Fragment p's `outer - local`, local being params after this step's inner update."""
    return [outer_now[i] - (params[i] + updates[i]).astype(params[i].dtype)
            for i in self.plan[p]]

  def exchange(self, p, updates, params, outer_now, residual):
    """Fragment p's pseudo-gradient averaged over every replica, and the residual."""
    delta = self.pseudo_gradient(p, updates, params, outer_now)
    with collectives.measure("DiLoCo") as ledger:
      if feeds_back(self.codec):
        averaged, missed = encoded_mean(delta, [residual[i] for i in self.plan[p]],
                                        self.codec)
        residual = list(residual)
        for i, value in zip(self.plan[p], missed):
          residual[i] = value
      else:
        averaged = replica_mean(delta, self.codec)
    self.sent[p + 1] = ledger.bytes
    return averaged, residual

  def apply(self, p, averaged, updates, params, outer_now, outer_states):
    """Fragment p's outer step; its updates move params to the merged values."""
    mine = [outer_now[i] for i in self.plan[p]]
    steps, state_p = self.outer.update(averaged, outer_states[p], mine)
    moved = optax.apply_updates(mine, steps)
    updates, outer_now, outer_states = list(updates), list(outer_now), list(outer_states)
    for i, new in zip(self.plan[p], moved):
      target = new
      if self.mix:
        local = params[i] + updates[i]
        target = (self.mix * local + (1.0 - self.mix) * new).astype(new.dtype)
      outer_now[i], updates[i] = new, (target - params[i]).astype(updates[i].dtype)
    outer_states[p] = state_p
    return updates, outer_now, tuple(outer_states)

  def start_background(self, p, updates, params, outer_now, pending, residual):
    """Starts fragment p's exchange (`diloco_background`): float32 shares summed, or
    a sparse payload gathered.

    Returns:
      (pending with this replica's share of the mean, the token, the residual).
    """
    delta = self.pseudo_gradient(p, updates, params, outer_now)
    if not isinstance(self.codec, SparseCodec):
      pending, token, self.sent[p + 1] = background.start(delta, pending, self.plan[p])
      return pending, token, residual
    spec, missed = fusion.flat_spec(delta), [residual[i] for i in self.plan[p]]
    x = fusion.ravel(delta, jnp.float32) + fusion.ravel(missed, jnp.float32)
    payload, sent = sparseloco.encode(x, spec, self.codec.ratio)
    token, self.sent[p + 1] = background.start_gather(payload.to_wire())
    share = sent * (1.0 / job_lib.current().replica_count)
    pending, residual = list(pending), list(residual)
    for i, mine, left in zip(self.plan[p], fusion.unravel(share, spec),
                             fusion.unravel(x - sent, fusion.flat_spec(missed))):
      pending[i], residual[i] = mine, left
    return pending, token, residual

  def finish_background(self, p, pending, token) -> list:
    """Fragment p's averaged pseudo-gradient, from its background exchange."""
    mine = [pending[i] for i in self.plan[p]]
    if not isinstance(self.codec, SparseCodec):
      return background.average(mine, token)
    ctx = sparseloco.context(fusion.flat_spec(mine), self.codec.ratio)

    def gathered_mean():
      everyone = background.finish_gather(token, sparseloco.wire_size(ctx))
      return sparseloco.decode_sum(everyone, ctx) * (1.0 / job_lib.current().replica_count)

    return background.average(mine, token, gathered_mean)

  def switch(self, index: jax.Array, branch, idle, *operands):
    """`lax.switch` on `index`: `idle(*operands)` at 0, `branch(p, *operands)` at 1 + p."""
    return lax.switch(index, [idle] + [functools.partial(branch, p)
                                       for p in range(len(self.plan))], *operands)


def sync_now(frags: _Fragments, due_now, updates, params, outer_now, outer_states, residual):
  """delay=0: a due fragment is exchanged and its outer step applied in this step.

  Returns:
    (updates, outer leaves, outer states, residual).
  """
  def sync(p, updates, params, outer_now, outer_states, residual):
    averaged, residual = frags.exchange(p, updates, params, outer_now, residual)
    return frags.apply(p, averaged, updates, params, outer_now, outer_states) + (residual,)

  return frags.switch(due_now, sync, lambda u, pa, o, s, res: (u, o, s, res),
                      updates, params, outer_now, outer_states, residual)


def sync_delayed(frags: _Fragments, due_now, due_then, updates, params, outer_now,
                 outer_states, residual, pending):
  """delay>0 in the step: exchange a due fragment now, apply the one exchanged τ steps ago.

  Returns:
    (updates, outer leaves, outer states, residual, pending leaves).
  """
  def stash(p, pending, residual, updates, params, outer_now):
    pending = list(pending)
    averaged, residual = frags.exchange(p, updates, params, outer_now, residual)
    for i, value in zip(frags.plan[p], averaged):
      pending[i] = value
    return pending, residual

  pending, residual = frags.switch(due_now, stash, lambda pend, res, *_: (pend, res),
                                   pending, residual, updates, params, outer_now)

  def apply_pending(p, updates, params, outer_now, outer_states, pending):
    return frags.apply(p, [pending[i] for i in frags.plan[p]], updates, params, outer_now,
                       outer_states)

  updates, outer_now, outer_states = frags.switch(
      due_then, apply_pending, lambda u, pa, o, s, pend: (u, o, s),
      updates, params, outer_now, outer_states, pending)
  return updates, outer_now, outer_states, residual, pending


def sync_background(frags: _Fragments, due_now, due_then, updates, params, outer_now,
                    outer_states, pending, in_flight, residual):
  """delay>0 on the native route: start a due fragment's exchange in the background,
  finish the one started τ steps ago and apply its outer step.

  Returns:
    (updates, outer leaves, outer states, pending leaves, in_flight, residual).
  """
  def start(p, pending, flight, residual, updates, params, outer_now):
    pending, token, residual = frags.start_background(p, updates, params, outer_now,
                                                      pending, residual)
    return pending, flight.at[p].set(token), residual

  pending, in_flight, residual = frags.switch(
      due_now, start, lambda pend, flight, res, *_: (pend, flight, res),
      pending, in_flight, residual, updates, params, outer_now)

  def finish(p, updates, params, outer_now, outer_states, pending, flight):
    averaged = frags.finish_background(p, pending, flight[p])
    return frags.apply(p, averaged, updates, params, outer_now, outer_states) + (
        flight.at[p].set(0),)

  updates, outer_now, outer_states, in_flight = frags.switch(
      due_then, finish, lambda u, pa, o, s, pend, flight: (u, o, s, flight),
      updates, params, outer_now, outer_states, pending, in_flight)
  return updates, outer_now, outer_states, pending, in_flight, residual


def diloco(inner: optax.GradientTransformation, *, sync_every: int,
           outer: optax.GradientTransformation | None = None, fragments: int = 1,
           delay: int = 0, mix: float = 0.0, payload: Any = None) -> optax.GradientTransformation:
  """DiLoCo (fragments=1) or Streaming DiLoCo (fragments > 1) around `inner`.

  Use it in place of `jdist.dist_opt(inner)`, in a data-parallel step:
  `updates, state = tx.update(grads, state, params)` with this replica's own
  (un-averaged) gradients, then `optax.apply_updates(params, updates)`.

  Args:
    inner: the inner optimizer (e.g. `optax.adamw(...)`); its state stays
      per replica.
    sync_every: H, inner steps between two outer steps of a fragment.
    outer: the outer optimizer, applied to the averaged pseudo-gradient
      `outer_params - local_params`; default `optax.sgd(0.7, momentum=0.9,
      nesterov=True)`, the paper's, set for an inner AdamW (or any inner
      optimizer whose step is about its learning rate). An inner SGD with
      heavy-ball momentum β takes steps 1/(1-β) times larger: scale the outer
      learning rate by (1-β) (`jdist train` does, see docs/diloco.md).
      `optax.sgd(1.0)` makes it parameter averaging.
    fragments: P, fragments of whole leaves, synced on staggered steps
      (Streaming DiLoCo); 1 <= P <= H.
    delay: τ, inner steps between a fragment's exchange and the outer step
      that applies it; 0 <= τ < H.
    mix: on applying, the local share kept: local becomes `mix * local +
      (1 - mix) * outer` (0 <= mix < 1; Streaming DiLoCo uses 0.5 with a delay).
    payload: what the pseudo-gradient crosses replicas as: None or
      "float32" (full precision); "fp16"/"bf16" (or the jnp dtype), 16 bits
      (`jdist.cast`'s codec); "int8"/"int4", 8-/4-bit levels with a float32
      scale per `PAYLOAD_BLOCK` values and error feedback; "sparse" or
      "sparse:RATIO", SparseLoCo's top RATIO (default
      `sparseloco.DEFAULT_RATIO`) of each chunk in 2 bits with error
      feedback (see the module docstring).

  Returns:
    An `optax.GradientTransformation` whose state is a `DiLoCoState`.

  Raises:
    ValueError: a bad argument, naming it (more fragments than leaves at init).
  """
  outer = check_arguments(inner, sync_every, outer, fragments, delay, mix)
  codec = payload_codec(payload)
  feedback = feeds_back(codec)  # keeps an error-feedback residual
  offsets = sync_offsets(sync_every, fragments)

  def plan_for(leaves):
    return fragment_plan([math.prod(leaf.shape) for leaf in leaves], fragments)

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    return DiLoCoState(
        step=jnp.zeros([], jnp.int32), inner_state=inner.init(params),
        outer_params=jax.tree.map(jnp.array, params),
        outer_states=tuple(outer.init([leaves[i] for i in leaves_p])
                           for leaves_p in plan_for(leaves)),
        pending=jax.tree.map(jnp.zeros_like, params) if delay else (),
        syncs=jnp.zeros([], jnp.int32), wire_bytes=jnp.zeros([], jnp.float32),
        residual=(jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, jnp.float32), params)
                  if feedback else ()),
        in_flight=jnp.zeros((fragments,) + background.TOKEN_SHAPE, jnp.int32) if delay else ())

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError("jdist.diloco keeps local parameters, so tx.update needs them: "
                       "call tx.update(grads, opt_state, params).")
    inner_updates, inner_state = inner.update(grads, state.inner_state, params)
    updates, treedef = jax.tree.flatten(inner_updates)
    param_leaves = treedef.flatten_up_to(params)
    frags = _Fragments(outer, plan_for(param_leaves), codec, mix)
    step = state.step + 1
    index = due(step, offsets, sync_every)
    # Error feedback's residual, per leaf; [] without it (exchanges keep it).
    residual = treedef.flatten_up_to(state.residual) if feedback else []
    pending, in_flight = state.pending, state.in_flight
    operands = (updates, param_leaves, treedef.flatten_up_to(state.outer_params),
                state.outer_states)
    if background.applies(delay, codec is None or isinstance(codec, SparseCodec)):
      updates, outer_leaves, outer_states, pending, in_flight, residual = sync_background(
          frags, index, due(step - delay, offsets, sync_every), *operands,
          treedef.flatten_up_to(pending), in_flight, residual)
    elif delay:
      updates, outer_leaves, outer_states, residual, pending = sync_delayed(
          frags, index, due(step - delay, offsets, sync_every), *operands, residual,
          treedef.flatten_up_to(pending))
    else:
      updates, outer_leaves, outer_states, residual = sync_now(frags, index, *operands,
                                                               residual)
    new_state = DiLoCoState(
        step=step, inner_state=inner_state,
        outer_params=jax.tree.unflatten(treedef, outer_leaves), outer_states=outer_states,
        pending=jax.tree.unflatten(treedef, pending) if delay else (),
        syncs=state.syncs + (index > 0).astype(jnp.int32),
        wire_bytes=jnp.asarray(frags.sent, jnp.float32)[index],
        residual=jax.tree.unflatten(treedef, residual) if feedback else (),
        in_flight=in_flight)
    return jax.tree.unflatten(treedef, updates), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def scale_outer_lr(opt_state: Any, factor: float) -> Any:
  """`opt_state` with every `diloco` state's outer learning rate times `factor`.

  The outer momentum is cleared too: it holds the steps taken at the old
  rate. Elementwise on the state's own arrays (their sharding is kept);
  under mpirun every process calls it alike.

  Raises:
    ValueError: no `diloco` state, or an outer optimizer whose learning rate
      is not in its state (build it with `optax.inject_hyperparams`, as
      `jdist train --diloco-backoff` does).
  """
  found = []

  def scale(state):
    if not isinstance(state, DiLoCoState):
      return state
    outer_states = []
    for outer_state in state.outer_states:
      hyperparams = getattr(outer_state, "hyperparams", None)
      if not isinstance(hyperparams, dict) or "learning_rate" not in hyperparams:
        raise ValueError("the DiLoCo outer optimizer's learning rate is not in its state: "
                         "build it with optax.inject_hyperparams(optax.sgd)(...).")
      outer_states.append(outer_state._replace(
          hyperparams={**hyperparams, "learning_rate": hyperparams["learning_rate"] * factor},
          inner_state=jax.tree.map(lambda leaf: leaf * 0, outer_state.inner_state)))
    found.append(state)
    return state._replace(outer_states=tuple(outer_states))

  scaled = jax.tree.map(scale, opt_state, is_leaf=lambda x: isinstance(x, DiLoCoState))
  if not found:
    raise ValueError("opt_state holds no jdist.diloco state.")
  return scaled


def outer_syncs(opt_state: Any) -> jax.Array:
  """Outer syncs (fragment exchanges) so far, of every `diloco`/`local_sgd` state in `opt_state`."""
  found = [jnp.asarray(state.syncs, jnp.int32)
           for state in protocol.wire_states(opt_state) if hasattr(state, "syncs")]
  return sum(found, jnp.zeros([], jnp.int32))
