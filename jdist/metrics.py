"""Loss and accuracy over every replica, exact when batches are short or padded.

Averaging per-replica means is wrong as soon as replicas see different numbers
of real examples (the last, short batch of an epoch, padded to a static
shape): a replica holding 3 real rows would weigh as much as one holding 8.
Instead every step reduces *sums* over all replicas (SINGA's
`reduce_variable`; the m_k/n weights of the Needle DDP report):

    loss     = sum_i w_i * loss_i    / sum_i w_i
    accuracy = sum_i w_i * correct_i / sum_i w_i

over every example i of every replica, where padded rows have w_i = 0. Inside
the step, `metric_sums` returns these sums already reduced over the replicas;
on the host, `MetricAccumulator` adds them up over steps without waiting for
each step (it keeps the device arrays and reads them all at the end).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist import errors
from jdist import parallel
from jdist.collectives import ops

# Keys of the dict `metric_sums` returns.
LOSS_SUM = "loss_sum"
CORRECT_SUM = "correct_sum"
WEIGHT_SUM = "weight_sum"
COUNT = "count"
_KEYS = (LOSS_SUM, CORRECT_SUM, WEIGHT_SUM, COUNT)


def _per_example(name: str, value: Any, batch_shape: tuple[int, ...]) -> jax.Array:
  value = jnp.asarray(value)
  if value.shape != batch_shape:
    raise errors.ShapeError(
        f"jdist.metric_sums: {name} has shape {value.shape}, but loss_per_example has "
        f"shape {batch_shape}; pass one value per example (e.g. reduce the loss with "
        f"reduction='none' / optax's per-example losses, not .mean()).")
  return value.astype(jnp.float32)


def metric_sums(loss_per_example: Any, correct_per_example: Any,
                weights: Any = None) -> dict[str, jax.Array]:
  """Weighted sums of loss and correctness over every replica of the step.

  Call inside a `jdist.data_parallel` step with this replica's per-example
  values; every replica gets the same, globally reduced sums. Feed the step's
  output to `MetricAccumulator.add`.

  Args:
    loss_per_example: [batch] loss of each example (any float dtype).
    correct_per_example: [batch] 1/0 (or bool) per example, e.g.
      `jnp.argmax(logits, -1) == labels`.
    weights: [batch] non-negative weight of each example; 0 for padded rows.
      Default: every example weighs 1.

  Returns:
    A dict of float32 scalars summed over every replica: "loss_sum" (sum of
    w * loss), "correct_sum" (sum of w * correct), "weight_sum" (sum of w),
    and an int32 "count" (examples with w > 0).

  Raises:
    jdist.errors.ShapeError: the inputs are not [batch] vectors of one size.
    jdist.errors.CollectiveContextError: called outside a data-parallel step.
  """
  ops.require_data_parallel("jdist.metric_sums")
  loss = jnp.asarray(loss_per_example)
  if loss.ndim != 1:
    raise errors.ShapeError(
        f"jdist.metric_sums: loss_per_example has shape {loss.shape}; it must be a "
        f"[batch] vector with one loss per example.")
  loss = loss.astype(jnp.float32)
  correct = _per_example("correct_per_example", correct_per_example, loss.shape)
  if weights is None:
    weights = jnp.ones(loss.shape, jnp.float32)
  weights = _per_example("weights", weights, loss.shape)
  # A padded row may hold garbage (NaN loss from a zero input): 0 * NaN is
  # NaN, so select instead of multiplying.
  used = weights > 0
  sums = {
      LOSS_SUM: jnp.sum(jnp.where(used, weights * loss, 0.0)),
      CORRECT_SUM: jnp.sum(jnp.where(used, weights * correct, 0.0)),
      WEIGHT_SUM: jnp.sum(jnp.where(used, weights, 0.0)),
      COUNT: jnp.sum(used.astype(jnp.int32)),
  }
  return ops.psum(sums)


class MetricAccumulator:
  """Adds up `metric_sums` outputs over steps; returns exact global means.

  `add` keeps the step's device arrays without waiting for them (no host
  synchronization per step); `result` reads them all at once and sums in
  float64. Every replica holds the same reduced sums, so the accumulator reads
  only the first local replica's copy (`jdist.unreplicate`), and every process
  gets the same result.

  Example:
    ```python
    metrics = jdist.MetricAccumulator()
    for batch in loader:
      params, opt_state, sums = train_step(params, opt_state, batch)
      metrics.add(sums)
    print(metrics.result())   # {"loss": ..., "accuracy": ..., "count": ...}
    ```
  """

  # Pending device scalars are folded into host sums every this many steps,
  # bounding memory in long epochs; by then those steps are long finished.
  _FOLD_EVERY = 1024

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    """Forgets every step added so far (e.g. at the start of an epoch)."""
    self._pending: list[dict[str, Any]] = []
    self._totals = {key: 0.0 for key in _KEYS}
    self._steps = 0

  @property
  def steps(self) -> int:
    """Steps added since the last reset."""
    return self._steps

  def add(self, sums: dict[str, Any]) -> None:
    """Adds one step's `metric_sums` output.

    Args:
      sums: the dict returned by a `jdist.data_parallel` step (leading local
        device axis), or an already unreplicated one (scalars).

    Raises:
      ValueError: `sums` is not a `metric_sums` dict.
    """
    if not isinstance(sums, dict) or set(sums) != set(_KEYS):
      got = sorted(sums) if isinstance(sums, dict) else type(sums).__name__
      raise ValueError(
          f"MetricAccumulator.add expects the dict jdist.metric_sums returns (keys "
          f"{list(_KEYS)}), got {got}; return metric_sums(...) from the step and pass "
          f"it here unchanged.")
    if any(np.ndim(value) not in (0, 1) for value in sums.values()):
      raise ValueError("MetricAccumulator.add: each entry must be a scalar or a "
                       "[local_devices] vector of replicated scalars.")
    if any(np.ndim(value) == 1 for value in sums.values()):
      sums = parallel.unreplicate(sums)
    self._pending.append(dict(sums))
    self._steps += 1
    if len(self._pending) >= self._FOLD_EVERY:
      self._fold()

  def _fold(self) -> None:
    for step in jax.device_get(self._pending):
      for key in _KEYS:
        self._totals[key] += float(step[key])
    self._pending = []

  def sums(self) -> dict[str, float]:
    """The raw totals (float64 sums over every step added)."""
    self._fold()
    totals = dict(self._totals)
    totals[COUNT] = int(round(totals[COUNT]))
    return totals

  def result(self) -> dict[str, float]:
    """Exact global means over every example added since the last reset.

    Returns:
      {"loss": weighted mean loss, "accuracy": weighted fraction correct,
      "count": examples with weight > 0, "weight": total weight}.

    Raises:
      ValueError: nothing with positive weight was added.
    """
    totals = self.sums()
    weight = totals[WEIGHT_SUM]
    if not weight > 0:
      raise ValueError(
          f"MetricAccumulator.result: the total weight of the {self._steps} steps added "
          f"is {weight}, so no mean exists; add steps with real (weight > 0) examples "
          f"first, or check that padding weights are not all zero.")
    return {
        "loss": totals[LOSS_SUM] / weight,
        "accuracy": totals[CORRECT_SUM] / weight,
        "count": totals[COUNT],
        "weight": weight,
    }
