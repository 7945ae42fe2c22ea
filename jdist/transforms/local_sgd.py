"""Post-local SGD: synchronous at first, then local steps and periodic parameter averaging.

PyTorch's `PostLocalSGDOptimizer` with `post_localSGD_hook` (Lin et al.,
"Don't use large mini-batches, use local SGD", 2020): for the first
`warmup_steps` steps the gradients are averaged over every replica, as
`jdist.dist_opt` does; afterwards every replica steps with its own
gradients, and after every `sync_every` such local steps the parameters are
averaged over every replica. The inner optimizer's state stays per replica.

As in `jdist.diloco`, the step counter in the state decides, the same on
every replica, whether a step exchanges (inside `lax.cond`), so local steps
send no bytes. Local SGD is DiLoCo with the outer optimizer `optax.sgd(1.0)`,
without keeping outer parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jdist import collectives
from jdist.compression import protocol
from jdist.transforms import diloco as diloco_lib


@protocol.register_wire_state
class LocalSGDState(NamedTuple):
  """State of `local_sgd`.

  Attributes:
    step: steps taken (the same on every replica).
    inner_state: the inner optimizer's state, this replica's own.
    syncs: parameter averagings so far (warm-up steps not counted).
    wire_bytes: bytes this process sent across processes in the last step.
  """
  step: jax.Array
  inner_state: Any
  syncs: jax.Array
  wire_bytes: jax.Array


def local_sgd(inner: optax.GradientTransformation, *, sync_every: int,
              warmup_steps: int = 0) -> optax.GradientTransformation:
  """Post-local SGD around `inner`.

  Steps t = 0 .. warmup_steps - 1 average the gradients before `inner`;
  later steps use this replica's own gradients, and the steps t with
  `(t + 1 - warmup_steps) % sync_every == 0` average the parameters after
  `inner`'s update. Call `tx.update(grads, state, params)` with the
  replica's own gradients.

  Args:
    inner: the optimizer each replica runs (e.g. `optax.sgd(0.1, momentum=0.9)`).
    sync_every: H, local steps between two parameter averagings.
    warmup_steps: fully synchronous steps first (PyTorch's start_localSGD_iter).

  Returns:
    An `optax.GradientTransformation` whose state is a `LocalSGDState`.

  Raises:
    ValueError: a bad argument, naming it.
  """
  diloco_lib.check_inner(inner)
  diloco_lib.check_int("sync_every", sync_every, 1)
  diloco_lib.check_int("warmup_steps", warmup_steps, 0)

  def init_fn(params):
    return LocalSGDState(jnp.zeros([], jnp.int32), inner.init(params),
                         jnp.zeros([], jnp.int32), jnp.zeros([], jnp.float32))

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError("jdist.local_sgd averages parameters, so tx.update needs them: "
                       "call tx.update(grads, opt_state, params).")
    t = state.step
    sent = jnp.zeros([], jnp.float32)
    if warmup_steps:
      warm = t < warmup_steps
      with collectives.measure("local SGD") as ledger:
        grads = lax.cond(warm, lambda g: collectives.reduce_payload(g, mean=True),
                         lambda g: g, grads)
      sent = jnp.where(warm, float(ledger.bytes), 0.0)
    updates, inner_state = inner.update(grads, state.inner_state, params)

    def average(updates, params):
      local = optax.apply_updates(params, updates)
      averaged = collectives.reduce_payload(local, mean=True)
      return jax.tree.map(lambda a, p, u: (a - p).astype(u.dtype), averaged, params, updates)

    sync = (t >= warmup_steps) & ((t + 1 - warmup_steps) % sync_every == 0)
    with collectives.measure("local SGD") as ledger:
      updates = lax.cond(sync, average, lambda u, p: u, updates, params)
    sent = sent + jnp.where(sync, float(ledger.bytes), 0.0)
    return updates, LocalSGDState(t + 1, inner_state, state.syncs + sync.astype(jnp.int32),
                                  sent.astype(jnp.float32))

  return optax.GradientTransformation(init_fn, update_fn)
