"""Per-step counters of a timeline: compression ratio and error-feedback residual.

Two numbers say whether a compressed exchange does what it should:

  * the **compression ratio**: the bytes a dense all-reduce of the gradient
    would have sent across processes, over the bytes the step's jdist
    transformations did send (`jdist.wire_bytes`), both counted the way
    `jdist.collectives.wire` counts them (2(P-1)/P * b for a sum of b bytes);
  * the **residual norm**: the L2 norm, over every leaf, of what error
    feedback holds back (the `residual` field of `jdist.topk` /
    `jdist.threshold`, `jdist.powersgd` and `jdist.qsgd` states, and of any
    state NamedTuple with a `residual` or `error` field, wherever it sits in
    the optimizer state). A residual that keeps growing means the
    compression drops more than later steps make up.

`residual_norm` works on one replica's state (inside a step, like
`jdist.wire_bytes`). `Dispatcher` is what `jdist.timeline` runs after each
recorded step: one small compiled function over the whole process's state
(every local replica), dispatched without waiting for it; its values are
read once ready, so the steps never wait for the host.
"""

from __future__ import annotations

import functools
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
    2(P-1)/P times the gradient's bytes, as `jdist.collectives.wire` counts a sum.
  """
  nbytes = sum(int(np.size(leaf)) * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree.leaves(params))
  return 2 * (processes - 1) / processes * nbytes if processes > 1 else 0.0


def _wire_leaves(opt_state: Any) -> list[jax.Array]:
  return [s.wire_bytes for s in jax.tree.leaves(opt_state, is_leaf=protocol.is_wire_state)
          if protocol.is_wire_state(s)]


@functools.partial(jax.jit, static_argnums=2)
def _process_counters(residuals: list[jax.Array], sent: list[jax.Array], devices: int):
  """Per local replica: (sum of squared residual entries, bytes sent).

  Leaves carry the local device axis (sharded over it), so each device
  reduces its own replica's rows; nothing crosses devices.
  """
  zeros = jnp.zeros((devices,), jnp.float32)
  squares = sum((jnp.sum(jnp.square(r.astype(jnp.float32)).reshape(r.shape[0], -1), axis=1)
                 for r in residuals), zeros)
  return squares, sum((jnp.asarray(b, jnp.float32).reshape(-1) for b in sent), zeros)


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


class Dispatcher:
  """Dispatches the counters of the process's state; reads them once ready."""

  def __init__(self, processes: int):
    self.processes = processes
    self._shape: Any = None
    self._dense = 0.0
    self._picks: tuple[list[int], list[int]] = ([], [])  # residual, wire_bytes leaf indices
    self._devices: Any = None

  def dispatch(self, opt_state: Any, params: Any) -> Any:
    """Starts computing the counters of `opt_state` (leading local device axis).

    Returns:
      A handle for `read`, or None when the state has nothing to count.
    """
    shape = jax.tree.structure(opt_state)
    if self._shape is None or shape != self._shape:  # the same every step: checked once
      self._shape = shape
      leaves = jax.tree.leaves(params)
      devices = max(1, int(leaves[0].shape[0])) if leaves else 1
      self._dense = dense_wire_bytes(params, self.processes) / devices
      # Only the leaves counted go to the device function: a call per step stays cheap.
      index = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(opt_state))}
      self._picks = ([index[id(x)] for x in residual_leaves(opt_state) if np.size(x)],
                     [index[id(x)] for x in _wire_leaves(opt_state)])
      self._devices = devices
    residual, wire = self._picks
    if not (residual or wire):
      return None
    leaves = jax.tree.leaves(opt_state)
    squares, sent = _process_counters([leaves[i] for i in residual], [leaves[i] for i in wire],
                                      self._devices)
    return squares, sent, self._dense, bool(residual)

  @staticmethod
  def ready(handle: Any) -> bool:
    return all(a.is_ready() for a in handle[:2])

  @staticmethod
  def read(handle: Any) -> Counters:
    """The counters of a dispatched handle (waits for them if not ready)."""
    squares, sent, dense, residual = handle
    squares, sent = np.asarray(squares, np.float64), np.asarray(sent, np.float64)
    norm = math.sqrt(float(np.mean(squares))) if residual else None
    return Counters(norm, float(dense), float(sent.reshape(-1)[0]))
