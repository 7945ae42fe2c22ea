"""Per-step counters of a timeline: compression ratio and error-feedback residual.

Two numbers say whether a compressed exchange does what it should:

  * the **compression ratio**: the bytes a dense all-reduce of the gradient
    would have sent across processes, over the bytes the step's jdist
    transformations did send (`jdist.wire_bytes`), both counted the way
    `jdist.collectives.routes.base` counts them (2(P-1)/P * b for a sum of b bytes);
  * the **residual norm**: the L2 norm, over every leaf, of what error
    feedback holds back (the `residual` field of `jdist.topk` /
    `jdist.threshold`, `jdist.powersgd` and `jdist.qsgd` states, and of any
    state NamedTuple with a `residual` or `error` field, wherever it sits in
    the optimizer state). A residual that keeps growing means the
    compression drops more than later steps make up.

`residual_norm` works on one replica's state (inside a step, like
`jdist.wire_bytes`). `Dispatcher` is what `jdist.timeline` runs after each
recorded step: it keeps the state's `wire_bytes` leaves and dispatches one
small compiled reduction of the residual leaves (every local replica),
without waiting for it; the values are read once ready, so the steps never
wait for the host.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jdist.compression import protocol

RESIDUAL_FIELDS = ("residual", "error")


def _has_residual(node: Any) -> bool:
  fields = getattr(type(node), "_fields", None)
  return isinstance(node, tuple) and fields is not None and any(
      name in fields for name in RESIDUAL_FIELDS)


def residual_leaves(opt_state: Any) -> list[jax.Array]:
  """Every array held in a `residual`/`error` field of a state NamedTuple in `opt_state`."""
  out = []
  for node in jax.tree.leaves(opt_state, is_leaf=_has_residual):
    if _has_residual(node):
      for name in RESIDUAL_FIELDS:
        if name in type(node)._fields:
          out.extend(jax.tree.leaves(getattr(node, name)))
  return out


def has_residual(opt_state: Any) -> bool:
  """Whether `opt_state` holds an error-feedback residual with any entries."""
  return any(np.size(leaf) for leaf in residual_leaves(opt_state))


def residual_norm(opt_state: Any) -> jax.Array:
  """L2 norm over every leaf of the error-feedback residuals in `opt_state`.

  Args:
    opt_state: one replica's optimizer state (inside a step), or any pytree
      holding jdist compressor states.

  Returns:
    A float32 scalar; 0 when no state holds a residual (or error feedback is off).
  """
  squares = [jnp.sum(jnp.square(jnp.asarray(leaf, jnp.float32)))
             for leaf in residual_leaves(opt_state)]
  return jnp.sqrt(sum(squares, jnp.zeros([], jnp.float32)))


def dense_wire_bytes(params: Any, processes: int) -> float:
  """The bytes `jdist.allreduce` would count for a dense sum of a gradient like `params`.

  Args:
    params: one replica's parameters (the gradient has their dtypes and shapes).
    processes: processes in the job (one process sends nothing across processes).

  Returns:
    2(P-1)/P times the gradient's bytes, as `jdist.collectives.routes.base` counts a sum.
  """
  nbytes = sum(int(np.size(leaf)) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(params))
  return 2 * (processes - 1) / processes * nbytes if processes > 1 else 0.0


def _wire_leaves(opt_state: Any) -> list[jax.Array]:
  return [state.wire_bytes for state in protocol.wire_states(opt_state)]


@jax.jit
def _residual_squares(residuals: list[jax.Array]) -> jax.Array:
  """Per local replica, the sum of its squared residual entries.

  Leaves carry the local device axis (sharded over it), so each device
  reduces its own replica's rows; nothing crosses devices.
  """
  return sum(jnp.sum(jnp.square(r.astype(jnp.float32)).reshape(r.shape[0], -1), axis=1)
             for r in residuals)


class Counters(NamedTuple):
  """One step's counters on one rank.

  Attributes:
    residual_norm: root mean square over the rank's replicas of each
      replica's residual norm (its own norm with one device); None when the
      state holds no residual.
    dense_bytes: what a dense all-reduce of the gradient would have sent.
    sent_bytes: what the step's jdist transformations sent.
  """
  residual_norm: float | None
  dense_bytes: float
  sent_bytes: float

  @property
  def ratio(self) -> float | None:
    """dense / sent; None when nothing was sent (one process, or a local step)."""
    return self.dense_bytes / self.sent_bytes if self.sent_bytes > 0 else None


_PLANS: dict[tuple, tuple[float, tuple[list[int], list[int]]]] = {}
_MAX_PLANS = 8


def _plan(opt_state: Any, params: Any, processes: int):
  """(dense bytes per replica, (residual leaf indices, wire_bytes leaf indices))."""
  leaves = jax.tree.leaves(params)
  devices = max(1, int(leaves[0].shape[0])) if leaves else 1
  index = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(opt_state))}
  return dense_wire_bytes(params, processes) / devices, (
      [index[id(x)] for x in residual_leaves(opt_state) if np.size(x)],
      [index[id(x)] for x in _wire_leaves(opt_state)])


class Dispatcher:
  """Dispatches the counters of the process's state; reads them once ready."""

  def __init__(self, processes: int):
    self.processes = processes
    self._shape: Any = None
    self._dense = 0.0
    self._picks: tuple[list[int], list[int]] = ([], [])  # residual, wire_bytes leaf indices

  def dispatch(self, opt_state: Any, params: Any) -> Any:
    """Starts computing the counters of `opt_state` (leading local device axis).

    Returns:
      A handle for `read`, or None when the state has nothing to count.
    """
    leaves, shape = jax.tree.flatten(opt_state)
    if self._shape is None or shape != self._shape:  # the same every step: checked once
      self._shape = shape
      key = (shape, jax.tree.structure(params), self.processes)
      if key not in _PLANS:  # a later timeline of the same run finds it here
        _PLANS[key] = _plan(opt_state, params, self.processes)
        while len(_PLANS) > _MAX_PLANS:
          _PLANS.pop(next(iter(_PLANS)))
      self._dense, self._picks = _PLANS[key]
    residual, wire = self._picks
    if not (residual or wire):
      return None
    # The bytes sent are state leaves already: kept as they are, no device work.
    # The residual's norm is one small compiled reduction over its leaves only.
    squares = _residual_squares([leaves[i] for i in residual]) if residual else None
    return squares, [leaves[i] for i in wire], self._dense

  @staticmethod
  def _arrays(handle: Any) -> list[jax.Array]:
    return ([handle[0]] if handle[0] is not None else []) + list(handle[1])

  def ready(self, handle: Any) -> bool:
    """Whether `read` would not wait (a deleted array, donated to a later step, is ready)."""
    return all(a.is_deleted() or a.is_ready() for a in self._arrays(handle))

  def read(self, handle: Any) -> Counters | None:
    """The counters of a dispatched handle (waits for them if not ready).

    Returns:
      None if the step donated the state's buffers to the next one before
      they were read.
    """
    squares, wire, dense = handle
    if any(a.is_deleted() for a in self._arrays(handle)):
      return None
    norm = (math.sqrt(float(np.mean(np.asarray(squares, np.float64))))
            if squares is not None else None)
    sent = sum(float(np.asarray(w, np.float64).reshape(-1)[0]) for w in wire)
    return Counters(norm, float(dense), sent)
