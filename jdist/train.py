"""The training job: `train(config)` runs a whole data-parallel training run.

It is what `jdist train` runs (see `jdist.cli`), and a library function:

    from jdist.config import TrainConfig
    from jdist.train import train
    summary = train(TrainConfig(model="cnn", dataset="digits", epochs=3))

The same call works in one process (every local device a replica) and
under `mpirun` (every device of every process). Every rank builds the model
from a per-rank seed and takes rank 0's parameters (`jdist.broadcast_params`),
trains with `jdist.dist_opt` in the chosen communication mode, measures exact
weighted loss/accuracy over all replicas (`jdist.metric_sums`) and evaluates
every test example exactly once. Rank 0 prints one line per epoch, shows a
progress bar and writes a JSON-lines log and the checkpoints; a resumed run
continues bit for bit where the checkpoint left off.

Command line: `python -m jdist.train --help` (the same as `jdist train`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import time
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from jdist import collectives
from jdist import datasets
from jdist import errors
from jdist import models
from jdist import runlog
from jdist.collectives import host
from jdist.config import TrainConfig
from jdist.config import force_cpu_devices
from jdist.config import resume_conflicts
from jdist.optimizer_spec import OptimizerSpec
from jdist.config import validate

_IN_FLIGHT = 2  # train steps dispatched ahead of the host before it waits


def reached(max_steps: int | None, step: int) -> bool:
  return max_steps is not None and step >= max_steps


class TrainError(errors.JdistError):
  """The run cannot go on; raised on every process alike, so all exit cleanly."""


def _agree(fn, what: str):
  """Runs `fn` on every process; if it fails anywhere, raises TrainError everywhere."""
  result, problem = None, None
  try:
    result = fn()
  except (ValueError, OSError, errors.JdistError) as err:
    problem = str(err) if str(err) else type(err).__name__
  problems = host.allgather_object(problem, f"jdist train: {what}")
  for rank, rank_problem in enumerate(problems):
    if rank_problem is not None:
      where = f" (rank {rank})" if len(problems) > 1 and rank_problem != problem else ""
      raise TrainError(f"{what}{where}: {rank_problem}")
  return result


def _load_data(config: TrainConfig):
  data = datasets.load(config.dataset, config.data_dir, download=config.download)
  return data._replace(train_x=data.train_x[:config.train_limit],
                       train_y=data.train_y[:config.train_limit],
                       test_x=data.test_x[:config.test_limit],
                       test_y=data.test_y[:config.test_limit])


@functools.lru_cache(maxsize=8)
def _program(model_name: str, num_classes: int, input_shape: tuple,
             spec: OptimizerSpec, topo):
  """The run's model, optimizer and compiled functions.

  Cached, so that repeated runs in one process (tests, notebooks, sweeps)
  reuse the compilations instead of compiling every function again. The
  optimizer's spec is its whole key: whatever it holds builds the optimizer.
  """
  del topo  # part of the key only: the steps are pmapped over its devices
  model = models.create_model(model_name, num_classes=num_classes, input_shape=input_shape)
  tx = spec.build()

  @jax.jit
  def init(seed, process_index):
    # A per-rank seed (rank 0's values are broadcast). The "rbg" generator
    # compiles the initializers several times faster than threefry on CPU.
    key = jax.random.fold_in(jax.random.key(seed, impl="rbg"), process_index)
    variables = dict(model.init(key, jnp.zeros((1, *input_shape), jnp.float32), train=False))
    return variables.pop("params"), variables

  def per_example(logits, labels):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return losses, jnp.argmax(logits, axis=-1) == labels

  def train_step(params, model_state, opt_state, batch):
    def loss_fn(p):
      logits, new_state = models.apply_model(model, p, model_state, batch["x"], train=True)
      losses, correct = per_example(logits, batch["y"])
      return jnp.mean(losses), (losses, correct, new_state)

    grads, (losses, correct, new_state) = jax.grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    with collectives.measure() as ledger:
      # BatchNorm statistics are per replica; averaging keeps replicas identical.
      new_state = jdist.pmean(new_state) if new_state else new_state
      sums = jdist.metric_sums(losses, correct)
    wire = jdist.wire_bytes(opt_state) + ledger.bytes
    return params, new_state, opt_state, sums, wire

  def eval_step(params, model_state, batch):
    logits, _ = models.apply_model(model, params, model_state, batch["x"], train=False)
    losses, correct = per_example(logits, batch["y"])
    return jdist.metric_sums(losses, correct, batch["weight"])

  return types.SimpleNamespace(
      model=model, tx=tx, init=init, opt_init=jdist.data_parallel(tx.init),
      train_step=jdist.data_parallel(train_step), eval_step=jdist.data_parallel(eval_step))


def _fresh_position() -> dict:
  """Where a run stands, as stored in checkpoint metadata (see `_Run.save`)."""
  return {"epoch": 0, "batch_in_epoch": 0, "step": 0, "history": [], "epoch_sums": None,
          "epoch_wire": 0.0, "epoch_train_time": 0.0}


class _Run:
  """One training run's state and its steps; every method is collective."""

  def __init__(self, config: TrainConfig, topo, program, state: dict, loaders, out: runlog.RunOutput):
    self.config, self.topo, self.program, self.state, self.out = config, topo, program, state, out
    self.train_loader, self.test_loader = loaders
    self.steps_per_epoch = len(self.train_loader)
    self.position = _fresh_position()
    self.manager, self.synced_at = None, -1

  @property
  def step(self) -> int:
    return self.position["step"]

  def open_checkpoints(self) -> int | None:
    """Sets up checkpointing; resumes if asked. Returns the step resumed from."""
    config = self.config
    self.manager = _agree(lambda: jdist.CheckpointManager(config.checkpoint_dir, keep=3),
                          "checkpoint directory")
    exists = host.allgather_object(os.path.isdir(config.checkpoint_dir))[0]  # rank 0's view
    latest = self.manager.latest_step() if exists else None
    if latest is None:
      if config.resume:
        self.out.say(f"no checkpoint in {config.checkpoint_dir} yet: starting from scratch")
      return None
    if not config.resume:
      raise TrainError(
          f"{config.checkpoint_dir} already holds checkpoints (latest step {latest}); pass "
          f"--resume to continue that run, or choose an empty --checkpoint-dir.")
    saved = self.manager.read_metadata(latest)["user"]
    conflicts, notes = resume_conflicts(saved.get("config", {}), config)
    if conflicts:
      raise TrainError(
          f"cannot resume from {config.checkpoint_dir} (step {latest}): it belongs to a run "
          f"with other settings: {'; '.join(conflicts)}. Use the checkpoint's settings, or a "
          f"new --checkpoint-dir to start a new run.")
    for note in notes:
      self.out.say(f"note: resuming with a changed setting ({note}); the run will differ "
                   f"from an uninterrupted one.")
    self.state, saved = self.manager.restore(self.state, step=latest)
    self.position.update({k: saved[k] for k in self.position if k in saved})
    self.out.say(f"resumed from {config.checkpoint_dir} step {latest} (epoch "
                 f"{self.position['epoch'] + 1}, batch {self.position['batch_in_epoch']}/"
                 f"{self.steps_per_epoch})")
    return latest

  def check_replicas(self) -> None:
    from jdist import consistency  # pylint: disable=g-import-not-at-top
    consistency.check_replicas(
        {"params": self.state["params"], "model_state": self.state["model_state"]},
        raise_on_mismatch=True)

  def sync_for_use(self) -> None:
    """Under partial sync, averages the parameters before they are evaluated or saved."""
    if self.config.partial and self.synced_at != self.step:
      self.state["params"] = jdist.sync_params(self.state["params"])
      self.synced_at = self.step
      if self.config.check_replicas_every:
        self.check_replicas()

  def save(self, epoch: int, batch_in_epoch: int, epoch_so_far: dict) -> None:
    self.sync_for_use()
    if batch_in_epoch == self.steps_per_epoch:
      epoch, batch_in_epoch, epoch_so_far = epoch + 1, 0, {}
    self.position.update(_fresh_position(), **epoch_so_far, epoch=epoch,
                         batch_in_epoch=batch_in_epoch, step=self.step,
                         history=self.position["history"])
    metadata = {**self.position, "seed": self.config.seed, "config": self.config.to_dict(),
                "replica_count": self.topo.replica_count}
    self.manager.save(self.step, self.state, metadata=metadata)

  def evaluate(self) -> dict:
    self.sync_for_use()
    accumulator = jdist.MetricAccumulator()
    with contextlib.closing(self.test_loader.epoch(0)) as batches:
      for batch in batches:
        accumulator.add(self.program.eval_step(self.state["params"], self.state["model_state"],
                                               batch))
    return accumulator.result()

  def run_epoch(self, epoch: int) -> dict | None:
    """Trains one epoch (or its rest); returns its record, or None if stopped early."""
    config, state, position = self.config, self.state, self.position
    resuming = epoch == position["epoch"] and position["batch_in_epoch"] > 0
    batch_index = position["batch_in_epoch"] if resuming else 0
    carried = (position["epoch_sums"] or {}) if resuming else {}
    carried_wire = position["epoch_wire"] if resuming else 0.0
    carried_time = position["epoch_train_time"] if resuming else 0.0
    first_batch, epoch_start = batch_index, time.perf_counter()
    accumulator, wires, in_flight = jdist.MetricAccumulator(), [], collections.deque()
    saved_at = None

    def so_far() -> dict:
      sums = accumulator.sums()
      return {"epoch_sums": {k: sums[k] + carried.get(k, 0) for k in sums},
              "epoch_wire": carried_wire + sum(float(np.asarray(w)[0])
                                               for w in jax.device_get(wires)),
              "epoch_train_time": carried_time + time.perf_counter() - epoch_start}

    with self.out.bar(epoch, self.steps_per_epoch, batch_index) as bar, \
         contextlib.closing(self.train_loader.epoch(epoch, batch_index)) as batches:
      for batch in batches:
        (state["params"], state["model_state"], state["opt_state"], sums,
         wire) = self.program.train_step(state["params"], state["model_state"],
                                         state["opt_state"], batch)
        position["step"] += 1
        batch_index += 1
        accumulator.add(sums)
        wires.append(wire)
        # Bound the steps queued ahead: a steady pipeline, and a bar showing real progress.
        in_flight.append(sums)
        if len(in_flight) > _IN_FLIGHT:
          oldest = jax.device_get(in_flight.popleft())
          if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{oldest['loss_sum'][0] / oldest['weight_sum'][0]:.4f}",
                            refresh=False)
        every = config.check_replicas_every
        if every and not config.partial and self.step % every == 0:
          self.check_replicas()
        if (config.checkpoint_every and self.step % config.checkpoint_every == 0
            and batch_index < self.steps_per_epoch):
          self.save(epoch, batch_index, so_far())
          saved_at = self.step
        if reached(config.max_steps, self.step):
          break
      if bar is not None:
        bar.update(batch_index - bar.n)
    if batch_index < self.steps_per_epoch:  # stopped by max_steps
      if self.manager and saved_at != self.step:
        self.save(epoch, batch_index, so_far())
      self.out.say(f"stopped after step {self.step} (--max-steps), in epoch {epoch + 1} at "
                   f"batch {batch_index}/{self.steps_per_epoch}"
                   + ("; continue with --resume" if self.manager else ""))
      return None

    done = so_far()
    totals = done["epoch_sums"]
    record = {"event": "epoch", "epoch": epoch + 1, "step": self.step,
              "train_loss": totals["loss_sum"] / totals["weight_sum"],
              "train_accuracy": totals["correct_sum"] / totals["weight_sum"],
              "train_examples": totals["count"], "train_time_s": done["epoch_train_time"],
              "samples_per_s": (self.steps_per_epoch - first_batch) * config.batch_size
                               * self.topo.replica_count
                               / max(time.perf_counter() - epoch_start, 1e-9),
              "wire_bytes_per_step": done["epoch_wire"] / self.steps_per_epoch}
    if config.skip_nonfinite:
      record["skipped_steps"] = int(np.asarray(jax.device_get(state["opt_state"].skipped))[0])
    eval_start = time.perf_counter()
    last = epoch + 1 == config.epochs or reached(config.max_steps, self.step)
    if config.eval_every and ((epoch + 1) % config.eval_every == 0 or last):
      result = self.evaluate()
      record.update(test_loss=result["loss"], test_accuracy=result["accuracy"],
                    test_examples=result["count"])
    record["eval_time_s"] = time.perf_counter() - eval_start
    record["epoch_time_s"] = record["train_time_s"] + record["eval_time_s"]
    self.position["history"].append(record)
    if self.manager:
      self.save(epoch, self.steps_per_epoch, {})
    return record


def train(config: TrainConfig, *, return_state: bool = False) -> dict[str, Any]:
  """Runs (or resumes) the training run described by `config`.

  Collective: under mpirun every process calls it with the same config.

  Args:
    config: the run's settings; checked with `jdist.config.validate`.
    return_state: add "state" to the summary: host copies of the final
      {"params", "model_state"} of the first local replica.

  Returns:
    The summary (the log's final record): "epochs" (one record per epoch:
    train_loss, train_accuracy, test_loss, test_accuracy, epoch_time_s,
    samples_per_s, wire_bytes_per_step, ...), "steps", "final_test_accuracy",
    "best_test_accuracy", "total_time_s", "stopped_early", "topology",
    "config", ...

  Raises:
    ConfigError: a bad setting (before anything starts).
    TrainError: data that cannot be loaded, a dataset too small for one
      step, or a checkpoint directory that does not fit the run (on every
      process alike).
    jdist.errors.CheckpointError, jdist.consistency.ReplicaMismatchError:
      as their names say (on every process alike).
  """
  validate(config)
  if config.cpu_devices:
    force_cpu_devices(config.cpu_devices)

  started = time.perf_counter()
  topo = jdist.init(timeout=config.timeout,
                    backend=None if config.backend == "auto" else config.backend)
  out = runlog.RunOutput(config, topo.is_primary)
  data = _agree(lambda: _load_data(config), f"dataset {config.dataset!r}")
  input_shape = tuple(data.train_x.shape[1:])
  program = _agree(
      lambda: _program(config.model, data.num_classes, input_shape, config.optimizer_spec,
                       topo),
      f"model {config.model!r}")
  # Rank 0's parameters everywhere: an identical start.
  params, model_state = jdist.broadcast_params(program.init(config.seed, topo.process_index))
  state = {"params": jdist.replicate(params), "model_state": jdist.replicate(model_state)}
  state["opt_state"] = program.opt_init(state["params"])
  loaders = _agree(lambda: (
      jdist.ShardedLoader({"x": data.train_x, "y": data.train_y}, batch_size=config.batch_size,
                          topology=topo, seed=config.seed),
      jdist.ShardedLoader({"x": data.test_x, "y": data.test_y}, batch_size=config.eval_batch,
                          topology=topo, shuffle=False, drop_last=False,
                          pad_with_weights=True)), "data loader")
  run = _Run(config, topo, program, state, loaders, out)
  out.say(f"jdist train: {config.model} ({models.param_count(params):,} parameters) on "
          f"{data.name} ({len(data.train_x)} train / {len(data.test_x)} test); {topo}; "
          f"batch {config.batch_size} per replica = {config.batch_size * topo.replica_count} "
          f"per step, {run.steps_per_epoch} steps/epoch; {config.optimizer} lr {config.lr:g}; "
          f"{config.optimizer_spec.describe()}")
  resumed_from = run.open_checkpoints() if config.checkpoint_dir else None
  _agree(lambda: out.open_log(append=resumed_from is not None), f"log file {config.log_file!r}")

  stopped_early = False
  for epoch in range(run.position["epoch"], config.epochs):
    record = None if reached(config.max_steps, run.step) else run.run_epoch(epoch)
    if record is None:
      stopped_early = True
      break
    out.record(record)
    out.say(runlog.epoch_line(record, config.epochs))
    if reached(config.max_steps, run.step):
      stopped_early = epoch + 1 < config.epochs
      break

  history = run.position["history"]
  evaluated = [r["test_accuracy"] for r in history if "test_accuracy" in r]
  total_time = time.perf_counter() - started
  summary = {
      "event": "summary", "epochs_completed": len(history), "steps": run.step,
      "final_test_accuracy": evaluated[-1] if evaluated else None,
      "best_test_accuracy": max(evaluated) if evaluated else None,
      "total_time_s": total_time, "stopped_early": stopped_early,
      "resumed_from_step": resumed_from, "param_count": models.param_count(params),
      "topology": {"processes": topo.process_count, "local_devices": topo.local_device_count,
                   "replicas": topo.replica_count, "backend": topo.backend},
      "config": config.to_dict(), "epochs": history,
  }
  out.record(summary)
  out.close()
  final = (f"; final test accuracy {evaluated[-1]:.2%} (best {max(evaluated):.2%})"
           if evaluated else "")
  out.say(f"done: {len(history)} epoch(s), {run.step} steps in {total_time:.1f} s{final}")
  if return_state:
    summary["state"] = jax.device_get(jdist.unreplicate(
        {"params": run.state["params"], "model_state": run.state["model_state"]}))
  return summary


def main(argv=None) -> int:
  from jdist import cli  # pylint: disable=g-import-not-at-top
  return cli.train_main(argv, prog="python -m jdist.train")


if __name__ == "__main__":
  sys.exit(main())
