"""Worker section "time_to_accuracy": one variant trained until it reaches a test accuracy.

Runs in each rank of one job of `python -m benchmarks.time_to_accuracy`
(2 processes x 1 device, on one link). Trains SINGA's CNN
(`benchmarks.accuracy.build_model`, the same initial parameters on every
rank and in every variant) with batch `batch` per replica over the batches
of `benchmarks.accuracy.epoch_batches` (the same order everywhere):

  * a jdist mode of `benchmarks.accuracy.MODES` (`JdistTrainer`:
    `jdist.dist_opt(optax.sgd(0.005, momentum=0.9), **mode)`);
  * a torch variant, "ddp", "ddp_fp16" or "ddp_powersgd"
    (`benchmarks.torch_accuracy.TorchTrainer`: DDP over gloo from the same
    weights and rows).

Every `eval_every` steps (and after the last step) the training clock stops,
rank 0 measures the test accuracy and every rank takes rank 0's figure
(`jdist.runtime.host.allgather_object`), so all ranks decide alike whether
the target is reached; with `stop_at_target` the run ends there. Rows: one
per evaluation (`kind` "eval": step, epoch fraction, training seconds so
far, test accuracy, mean training loss since the previous one), then one
`kind` "final" row (time and steps to target, None if never reached; the
median, first and total step time; bytes sent per step for jdist).

The training clock is the sum of step times, each from taking the batch's
rows to the step's results being ready (`jax.block_until_ready`; DDP's
backward waits for its all-reduces), so evaluation never counts; jdist's
first step includes its compilation (`first_step_s` says how long).

Options (ctx.options): `variant`, `dataset`, `limit`, `epochs`, `batch`,
`target`, `eval_every` (0: a quarter epoch), `stop_at_target`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Iterator

import jax

import jdist
from benchmarks import accuracy
from benchmarks import workload
from jdist.runtime import host

TORCH_VARIANTS = ("ddp", "ddp_fp16", "ddp_powersgd")


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When a run evaluates and when it may stop.

  Attributes:
    epochs: the most epochs it trains.
    steps_per_epoch: steps in one epoch.
    eval_every: steps between two evaluations.
    target: the test accuracy it trains to reach.
    stop_at_target: end at the first evaluation at or above `target`.
  """
  epochs: int
  steps_per_epoch: int
  eval_every: int
  target: float
  stop_at_target: bool = True

  @property
  def total_steps(self) -> int:
    return self.epochs * self.steps_per_epoch

  def evaluates_after(self, step: int) -> bool:
    """Whether step `step` (counted from 1) is followed by an evaluation."""
    return step % self.eval_every == 0 or step == self.total_steps


def default_eval_every(steps_per_epoch: int) -> int:
  """A quarter epoch (at least one step)."""
  return max(1, steps_per_epoch // 4)


def first_at_target(curve: list[dict], target: float) -> dict | None:
  """The first evaluation whose test accuracy is at least `target`, or None."""
  return next((point for point in curve if point["test_accuracy"] >= target), None)


def run_to_target(trainer, schedule: Schedule, batches: Callable[[int], Any], *,
                  is_root: bool, share: Callable[[Any], Any],
                  clock: Callable[[], float] = time.perf_counter) -> Iterator[dict]:
  """Trains `trainer` on `schedule`; yields each evaluation's row, then the final row.

  Args:
    trainer: has `step(indices) -> loss` (returns once the step is done),
      `sync()` (collective: makes the parameters testable), `evaluate() ->
      accuracy` (called on the root rank only) and `wire_bytes()`.
    schedule: the epochs, evaluations and target.
    batches: epoch -> its steps' example indices, [steps, replicas, batch].
    is_root: whether this rank measures the accuracy.
    share: the root's value on every rank (a collective); with it every rank
      stops after the same step.
    clock: seconds, for the step times.
  """
  step_times: list[float] = []
  losses: list[float] = []
  curve: list[dict] = []
  step = 0
  stop = False
  for epoch in range(schedule.epochs):
    for indices in batches(epoch):
      start = clock()
      losses.append(trainer.step(indices))
      step_times.append(clock() - start)
      step += 1
      if not schedule.evaluates_after(step):
        continue
      trainer.sync()
      point = {"kind": "eval", "step": step, "epoch": step / schedule.steps_per_epoch,
               "train_s": sum(step_times),
               "test_accuracy": share(trainer.evaluate() if is_root else None),
               "train_loss": sum(losses) / len(losses)}
      losses.clear()
      curve.append(point)
      yield point
      stop = schedule.stop_at_target and point["test_accuracy"] >= schedule.target
      if stop:
        break
    if stop:
      break
  reached = first_at_target(curve, schedule.target)
  yield {"kind": "final", "steps": step, "epochs_trained": step / schedule.steps_per_epoch,
         "completed_all_epochs": step == schedule.total_steps,
         "stopped_at_target": stop, "train_s": sum(step_times),
         "median_step_s": statistics.median(step_times) if step_times else None,
         "first_step_s": step_times[0] if step_times else None,
         "final_accuracy": curve[-1]["test_accuracy"] if curve else None,
         "reached_step": reached and reached["step"],
         "epochs_to_target": reached and reached["epoch"],
         "time_to_target_s": reached and reached["train_s"],
         "wire_bytes_per_step": trainer.wire_bytes()}


class JdistTrainer:
  """One jdist mode's run: `step(indices)` trains on a batch, `evaluate()` tests.

  Args:
    mode: a key of `benchmarks.accuracy.MODES`.
    model: the flax CNN.
    params: its initial parameters (the same on every rank).
    data: the `jdist.app.datasets.Dataset`.
    replicas: the replica indices whose rows this process's devices train on.
  """

  framework = "jdist"

  def __init__(self, mode: str, model, params: Any, data, replicas):
    self.partial = "partial" in accuracy.MODES[mode]
    tx = accuracy.mode_transformation(mode)
    self.train_step = workload.jdist_step(model, tx)
    self.params = jdist.replicate(params)
    self.opt_state = jdist.data_parallel(tx.init)(self.params)
    self.test_params = None
    self.replicas = list(replicas)
    self.data = data
    self.accuracy_of = accuracy.make_evaluate(model, data)

  def step(self, indices) -> float:
    rows = indices[self.replicas]  # [local devices, batch]
    self.params, self.opt_state, loss = self.train_step(
        self.params, self.opt_state, workload.shard(self.data.train_x[rows]),
        workload.shard(self.data.train_y[rows]))
    jax.block_until_ready((self.params, self.opt_state, loss))
    return float(loss[0])

  def sync(self) -> None:
    """Partial sync's replicas differ between syncs: test their average."""
    synced = jdist.sync_params(self.params) if self.partial else self.params
    self.test_params = jdist.unreplicate(synced)

  def evaluate(self) -> float:
    return self.accuracy_of(self.test_params)

  def wire_bytes(self) -> float:
    return float(jdist.wire_bytes(jdist.unreplicate(self.opt_state)))

  def details(self) -> dict[str, Any]:
    return {}


def trainer_for(variant: str, model, params, data, replicas):
  """The trainer of a jdist mode or a torch variant (torch imported only then)."""
  if variant in TORCH_VARIANTS:
    from benchmarks import torch_accuracy  # pylint: disable=import-outside-toplevel
    return torch_accuracy.TorchTrainer(variant, model, params, data, replicas)
  if variant not in accuracy.MODES:
    raise ValueError(f"Unknown variant {variant!r}: choose from {list(accuracy.MODES)} "
                     f"or {list(TORCH_VARIANTS)}.")
  return JdistTrainer(variant, model, params, data, replicas)


def run(ctx):
  """The section: the variant of `ctx.options` trained to its target, row by row."""
  options = ctx.options
  variant = options["variant"]
  batch = int(options.get("batch", 32))
  data = accuracy.load_data(options.get("dataset", "auto"), options.get("limit"))
  model, params = accuracy.build_model(data)
  replicas = ctx.topo.replica_count
  steps_per_epoch = len(accuracy.epoch_batches(len(data.train_y), replicas, batch, 0))
  schedule = Schedule(int(options.get("epochs", 4)), steps_per_epoch,
                      int(options.get("eval_every") or default_eval_every(steps_per_epoch)),
                      float(options.get("target", 0.88)),
                      bool(options.get("stop_at_target", True)))
  if variant in TORCH_VARIANTS:
    from benchmarks import torch_peer  # pylint: disable=import-outside-toplevel
    torch_peer.init(ctx.rank, ctx.topo.process_count)  # gloo; threads: cores / processes
  trainer = trainer_for(variant, model, params, data, ctx.topo.replica_indices)
  about = {"variant": variant, "framework": trainer.framework}
  ctx.sync()
  rows = run_to_target(
      trainer, schedule,
      lambda epoch: accuracy.epoch_batches(len(data.train_y), replicas, batch, epoch),
      is_root=ctx.rank == 0,
      share=lambda value: host.allgather_object(value, "time_to_accuracy decision")[0])
  for row in rows:
    if row["kind"] == "final":
      row.update(trainer.details(), dataset=data.name, train_examples=len(data.train_y),
                 test_examples=len(data.test_y), replicas=replicas, batch_per_replica=batch,
                 steps_per_epoch=steps_per_epoch, eval_every=schedule.eval_every,
                 epochs=schedule.epochs, target=schedule.target)
    yield dict(about, **row)
