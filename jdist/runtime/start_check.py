"""Do the replicas start from the same parameters? A one-time check.

Data parallelism keeps replicas equal only if they start equal: parameters
initialized per process (seeded by rank) and never passed through
`jdist.broadcast_params` train as different models, silently. So the first
time a jdist optimizer (`jdist.dist_opt`, `jdist.allreduce`) is initialized
on the host with concrete parameters (`tx.init(params)`, the jit style's
way), every process hashes the parameters' bytes and the digests cross
processes in one small all-gather. Processes whose digest differs from rank
0's are remembered, and the first step that traces the optimizer's update
raises on every process, naming them and the fix. `jdist.broadcast_params`
afterwards (the start equal after all) clears it.

One hash of the parameters and one host exchange per `tx.init`, none per
step; a jdist transformation inside another one's init (`jdist.allreduce` in
`jdist.dist_opt`'s chain) compares nothing more. Whether a call exchanges
depends on the program alone, never on memory addresses (a cache keyed by
`id()` once let one rank skip the exchange when the allocator reused an
address, and the ranks' host exchanges went out of step). An init traced
inside a step (`jdist.data_parallel(tx.init)`) sees no values and checks
nothing. `JDIST_CHECK_START=0` turns the check off.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

import jax
import numpy as np
import optax

from jdist import errors
from jdist.runtime import job as job_lib

ENABLE_ENV = "JDIST_CHECK_START"
_pending: str | None = None  # the error the next traced update raises
# The leaves that enclosing `guarded` inits are comparing now, innermost last.
_enclosing = threading.local()


def enabled() -> bool:
  return os.environ.get(ENABLE_ENV, "1") != "0"


def fingerprint(tree: Any) -> str:
  """A digest of every leaf's bytes, shape and dtype (host side)."""
  digest = hashlib.blake2b(digest_size=16)
  for leaf in jax.tree.leaves(tree):
    value = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f"{value.shape}{value.dtype}".encode())
    # As bytes: a buffer of ml_dtypes' bfloat16 (or float8) cannot be hashed as it is.
    digest.update(value.reshape(-1).view(np.uint8).data)
  return digest.hexdigest()


def note_initial_params(params: Any, what: str) -> None:
  """Compares `params` across processes, once per tree (collective on the host).

  A no-op in one process, when disabled, or for traced values.
  """
  global _pending
  world = job_lib.world()
  if not enabled() or world is None or world.size == 1:
    return
  leaves = jax.tree.leaves(params)
  if not leaves or any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
    return
  if _compared_by_an_enclosing_init(leaves):
    return
  digests = world.allgather_object(fingerprint(leaves), f"{what}: comparing initial parameters")
  differ = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
  _pending = None if not differ else (
      f"{what}: the processes start from different parameters: rank(s) "
      f"{', '.join(map(str, differ))} hold other values than rank 0 (parameter "
      f"fingerprints {', '.join(f'rank {r}: {d[:8]}' for r, d in enumerate(digests))}), so "
      f"the replicas would train as {len(set(digests))} different models. Start every "
      f"process from rank 0's values: params = jdist.broadcast_params(params) before "
      f"tx.init(params) (or initialize them from the same seed on every process).")


def _compared_by_an_enclosing_init(leaves: list) -> bool:
  """Whether a `guarded` init around this call is comparing these very leaves."""
  stack = getattr(_enclosing, "stack", ())
  return bool(stack) and len(stack[-1]) == len(leaves) and all(
      mine is theirs for mine, theirs in zip(stack[-1], leaves))


def params_broadcast() -> None:
  """`jdist.broadcast_params` ran: the processes now hold the same values."""
  global _pending
  _pending = None


def check_at_step() -> None:
  """Raises, where the initial parameters differed (see `note_initial_params`).

  Call where a step traces the optimizer's update: every process traces its
  first step, and every process holds the same verdict.

  Raises:
    jdist.errors.WorldMismatchError: naming the ranks and the fix.
  """
  global _pending
  if _pending is not None:
    message, _pending = _pending, None
    raise errors.WorldMismatchError(message)


def guarded(tx: optax.GradientTransformation, what: str) -> optax.GradientTransformation:
  """`tx`, whose init checks the initial parameters and whose update `check_at_step`s."""
  def init_fn(params):
    note_initial_params(params, what)
    stack = _enclosing.__dict__.setdefault("stack", [])
    stack.append(jax.tree.leaves(params))  # held for this call only
    try:
      return tx.init(params)
    finally:
      stack.pop()

  def update_fn(updates, state, params=None, **extra_args):
    check_at_step()
    if extra_args:
      return tx.update(updates, state, params, **extra_args)
    return tx.update(updates, state, params)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
