"""Worker measurement "time_to_accuracy": one variant trained until it reaches a test accuracy
(a jdist mode, DDP or `<mode>_paired`; the method: docs/diloco.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np
import optax

import jdist
from benchmarks.harness import workload
from benchmarks.sections import accuracy
from jdist.compression import protocol
from jdist.runtime import host

TORCH_VARIANTS = ("ddp", "ddp_fp16", "ddp_powersgd", "ddp_postlocal")
FLOOR = "compute_floor"


@dataclasses.dataclass(frozen=True)
class Schedule:
  """When a run evaluates and when it stops."""
  epochs: int
  steps_per_epoch: int
  eval_every: int
  target: float
  stop_at_target: bool = True
  max_seconds: float = 0.0

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
  """Trains `trainer` on `schedule`; yields each evaluation's row (the clock stopped), then the
  final row. `trainer.step(indices)` -> loss or (loss, its seconds); `batches(epoch)` -> its
  steps' indices [steps, replicas, batch]; `share(value)`: the root's value everywhere.
  """
  step_times: list[float] = []
  losses: list[float] = []
  curve: list[dict] = []
  step = 0
  stop = False
  capped = False
  trained = 0.0  # training seconds so far
  for epoch in range(schedule.epochs):
    for indices in batches(epoch):
      start = clock()
      loss = trainer.step(indices)
      loss, seconds = loss if isinstance(loss, tuple) else (loss, clock() - start)
      losses.append(loss)
      step_times.append(seconds)
      step += 1
      trained += step_times[-1]
      # Rank 0's clock decides (shared outside the clock): ranks that decide
      # apart would run different exchanges (one evaluating, one stepping).
      capped = bool(schedule.max_seconds) and bool(share(trained >= schedule.max_seconds))
      if not (schedule.evaluates_after(step) or capped):
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
      capped = capped and not stop
      if stop or capped:
        break
    if stop or capped:
      break
  reached = first_at_target(curve, schedule.target)
  yield {"kind": "final", "steps": step, "epochs_trained": step / schedule.steps_per_epoch,
         "completed_all_epochs": step == schedule.total_steps,
         "stopped_at_target": stop, "capped": capped,
         "max_seconds": schedule.max_seconds or None, "train_s": sum(step_times),
         "median_step_s": statistics.median(step_times) if step_times else None,
         "first_step_s": step_times[0] if step_times else None,
         "final_accuracy": curve[-1]["test_accuracy"] if curve else None,
         "reached_step": reached and reached["step"],
         "epochs_to_target": reached and reached["epoch"],
         "time_to_target_s": reached and reached["train_s"],
         "wire_bytes_per_step": trainer.wire_bytes()}


class JdistTrainer:
  """One jdist mode's run (a key of `accuracy.MODES`): `step(indices)`, `evaluate()`."""

  framework = "jdist"

  def __init__(self, mode: str, model, params: Any, data, replicas):
    tx = accuracy.mode_transformation(mode)
    # Local-update modes: nothing crosses processes between syncs, not even the loss.
    step = workload.compute_step if mode in accuracy.LOCAL_MODES else workload.jdist_step
    self.start(mode, tx, step(model, tx), params, replicas)
    self.data = data
    self.accuracy_of = accuracy.make_evaluate(model, data)

  def start(self, mode: str, tx, train_step, params: Any, replicas) -> None:
    """Replicates `params` and `tx`'s state; `train_step(params, opt_state, *inputs)`."""
    self.partial = bool({"partial", "diloco", "local_sgd"} & set(accuracy.MODES[mode]))
    self.sent = []  # per step, the bytes the step sent (device scalars, read at the end)
    self.train_step = train_step
    self.params = jdist.replicate(params)
    self.opt_state = jdist.data_parallel(tx.init)(self.params)
    self.test_params = None
    self.replicas = list(replicas)

  def inputs(self, rows) -> tuple:
    """The step's batch for this process's example indices `rows`."""
    x, y = self.data.train_x[rows], self.data.train_y[rows]
    if len(self.replicas) == 1:
      return x, y
    return workload.shard(x), workload.shard(y)

  def step(self, indices) -> float:
    rows = indices[self.replicas]  # [local devices, batch]
    self.params, self.opt_state, loss = self.train_step(
        self.params, self.opt_state, *self.inputs(rows))
    jax.block_until_ready(loss)  # every output of the one execution is ready with it
    # The state's byte counters, added up after the run (`wire_bytes` would dispatch ops here).
    self.sent.append([state.wire_bytes for state in protocol.wire_states(self.opt_state)])
    return float(np.asarray(loss).reshape(-1)[0])

  def sync(self) -> None:
    """Tests the replicas' average where they differ between syncs (outside the clock)."""
    synced = jdist.sync_params(self.params) if self.partial else self.params
    self.test_params = jdist.unreplicate(synced)

  def evaluate(self) -> float:
    return self.accuracy_of(self.test_params)

  def wire_bytes(self) -> float | None:
    """Mean bytes sent per step over the steps so far (None before the first)."""
    if not self.sent:
      return None
    return float(sum(sum(float(np.asarray(counter).reshape(-1)[0]) for counter in step)
                     for step in self.sent) / len(self.sent))

  def details(self) -> dict[str, Any]:
    return {}


class FloorTrainer(JdistTrainer):
  """The compute floor: DiLoCo's inner step alone, nothing exchanged."""

  def __init__(self, model, params: Any, data, replicas):  # pylint: disable=super-init-not-called
    if len(replicas) != 1:
      raise ValueError(f"{FLOOR} runs one device per process; this process has "
                       f"{len(replicas)} replicas ({list(replicas)}). Use 2 processes x 1 "
                       "device, as benchmarks.sections.time_to_accuracy does.")
    tx = optax.sgd(accuracy.LEARNING_RATE, momentum=accuracy.MOMENTUM)
    self.train_step = workload.plain_jit_step(model, tx)
    self.params = jax.tree.map(jax.numpy.asarray, params)
    self.opt_state = tx.init(self.params)
    self.replicas = list(replicas)
    self.data = data
    self.accuracy_of = accuracy.make_evaluate(model, data)
    self.test_params = None

  def step(self, indices) -> float:
    rows = indices[self.replicas[0]]  # [batch]
    self.params, self.opt_state, loss = self.train_step(
        self.params, self.opt_state, self.data.train_x[rows], self.data.train_y[rows])
    jax.block_until_ready(loss)  # as JdistTrainer.step
    return float(loss)

  def sync(self) -> None:
    self.test_params = self.params

  def wire_bytes(self) -> float:
    return 0.0


class PairedTrainer:
  """`<mode>_paired`: a DiLoCo mode and its floors, a step each in turn; `step` -> (loss, the
  mode's seconds).
  """

  framework = "jdist"

  def __init__(self, variant: str, model, params: Any, data, replicas,
               clock=time.perf_counter):
    mode = variant[:-len(accuracy.PAIRED)]
    if "diloco" not in accuracy.MODES.get(mode, {}) or accuracy.never_syncs(mode):
      raise ValueError(f"{variant!r}: {accuracy.PAIRED} pairs a DiLoCo mode (e.g. "
                       f"sdiloco32_int4{accuracy.PAIRED}) with its floors.")
    self.mode = mode
    self.main = JdistTrainer(mode, model, params, data, replicas)
    self.floors = {
        FLOOR: FloorTrainer(model, params, data, replicas),
        mode + accuracy.NO_SYNC: JdistTrainer(
            mode + accuracy.NO_SYNC, model, params, data, replicas)}
    self.floor_seconds: dict[str, list[float]] = {name: [] for name in self.floors}
    self.clock = clock
    self.turn = 0

  def step(self, indices) -> tuple[float, float]:
    order = [(None, self.main)] + list(self.floors.items())
    shift = self.turn % len(order)  # who goes first: every one in turn
    self.turn += 1
    loss, seconds = None, None
    for name, trainer in order[shift:] + order[:shift]:
      start = self.clock()
      value = trainer.step(indices)
      elapsed = self.clock() - start
      if name is None:
        loss, seconds = value, elapsed
      else:
        self.floor_seconds[name].append(elapsed)
    return loss, seconds

  def sync(self) -> None:
    self.main.sync()

  def evaluate(self) -> float:
    return self.main.evaluate()

  def wire_bytes(self) -> float | None:
    return self.main.wire_bytes()

  def details(self) -> dict[str, Any]:
    """Each floor's training seconds after steps 1, 2, ... (`[s - 1]`: after step s)."""
    return {"paired_mode": self.mode,
            "paired_floors": {name: [round(total, 6) for total in itertools.accumulate(times)]
                              for name, times in self.floor_seconds.items()}}


def trainer_for(variant: str, model, params, data, replicas):
  """The trainer of a jdist mode or a torch variant (torch imported only then)."""
  if variant.endswith(accuracy.PAIRED):
    return PairedTrainer(variant, model, params, data, replicas)
  if variant in TORCH_VARIANTS:
    from benchmarks.sections.time_to_accuracy import (  # pylint: disable=g-import-not-at-top
        torch_trainer as torch_accuracy)
    return torch_accuracy.TorchTrainer(variant, model, params, data, replicas)
  if variant not in accuracy.MODES:
    raise ValueError(f"Unknown variant {variant!r}: choose from {list(accuracy.MODES)} "
                     f"or {list(TORCH_VARIANTS)}.")
  return JdistTrainer(variant, model, params, data, replicas)


NAME = "time_to_accuracy"  # the job results' key (benchmarks.harness.worker)


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
                      bool(options.get("stop_at_target", True)),
                      float(options.get("max_seconds") or 0.0))
  if variant in TORCH_VARIANTS:
    from benchmarks.harness import torch_peer  # pylint: disable=import-outside-toplevel
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
