"""The training job: `train(config)` runs a whole data-parallel training run.

It is what `jdist train` runs (see `jdist.app.cli`), and a library function:

    from jdist.app.config import TrainConfig
    from jdist.app.train import train
    summary = train(TrainConfig(model="cnn", dataset="digits", epochs=3))

The same call works in one process (every local device a replica) and
under `mpirun` (every device of every process). Every rank builds the model
from a per-rank seed and takes rank 0's parameters (`jdist.broadcast_params`),
trains with `jdist.dist_opt` in the chosen communication mode, measures exact
weighted loss/accuracy over all replicas (`jdist.metric_sums`) and evaluates
every test example exactly once. Rank 0 prints one line per epoch, shows a
progress bar and writes a JSON-lines log and the checkpoints; a resumed run
continues bit for bit where the checkpoint left off. The loop itself and the
guards that keep a run from going silently wrong (settings compared across
ranks, no NaN checkpointed, replica checksums, resume checks) are in
`jdist.app.train_loop` and `jdist.app.train_guard`.

Command line: `jdist train --help` (or `python -m jdist.app.cli train --help`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import types
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jdist
from jdist import collectives
from jdist.app import datasets
from jdist.app import elastic
from jdist.app import models
from jdist.app import runlog
from jdist.app import train_guard
from jdist.app.config import TrainConfig
from jdist.app.cpu_devices import force_cpu_devices
from jdist.app.optimizer_spec import OptimizerSpec
from jdist.app.config import validate
# The loop and its guards live in train_loop; these names stay importable here.
from jdist.app.train_loop import Run as _Run
from jdist.app.train_loop import TrainError  # pylint: disable=unused-import
from jdist.app.train_loop import agree as _agree
from jdist.app.train_loop import reached


def load_data(config: TrainConfig):
  """The dataset, cut to --train-limit / --test-limit; an empty split is an error."""
  data = datasets.load(config.dataset, config.data_dir, download=config.download)
  data = data._replace(train_x=data.train_x[:config.train_limit],
                       train_y=data.train_y[:config.train_limit],
                       test_x=data.test_x[:config.test_limit],
                       test_y=data.test_y[:config.test_limit])
  for split, examples in (("training", data.train_x), ("test", data.test_x)):
    if not len(examples):
      raise ValueError(f"the {split} split of {data.name} holds no examples; check the "
                       f"dataset's files (or --data-dir).")
  return data


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
    return models.example_losses(logits, labels), models.example_correct(logits, labels)

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


def _say_if_chance(out, config: TrainConfig, run, accuracy: float | None,
                   num_classes: int) -> None:
  """Says a warning when the final test accuracy is at chance, with the likely cause."""
  if accuracy is None or accuracy > 1.5 / num_classes:
    return
  if config.diloco:
    warned = (f"; the loss rose across outer syncs {run.alarms} time(s), see the warnings "
              f"above" if run.alarms else "")
    cause = (f"DiLoCo's outer step (outer lr {run.outer_lr:g}) is the likely cause{warned}: "
             f"lower --diloco-outer-lr or --diloco-outer-momentum, or add --diloco-backoff")
  else:
    cause = "lower --lr, or check the data and labels"
  out.say(f"warning: the final test accuracy {accuracy:.2%} is at chance (1 in {num_classes}): "
          f"the run did not learn; {cause}.")


def train(config: TrainConfig, *, return_state: bool = False) -> dict[str, Any]:
  """Runs (or resumes) the training run described by `config`.

  Collective: under mpirun every process calls it with the same config.

  Args:
    config: the run's settings; checked with `jdist.app.config.validate`.
    return_state: add "state" to the summary: host copies of the final
      {"params", "model_state", "opt_state"} of the first local replica.

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
  config, topo, out = _start(config)
  run, param_count = _prepare_run(config, topo, out)
  resumed_from = run.open_checkpoints() if config.checkpoint_dir else None
  _agree(lambda: out.open_log(append=resumed_from is not None), "log file", repr(config.log_file))
  stopped_early = _train_epochs(run, config, out)

  # The state handed back (and the last checkpoint) must be finite and agree everywhere.
  run.sync_for_use(final=True)
  run.finite("at the end of training")
  if config.check_replicas_every and not config.partial:
    run.check_replicas()
  summary = _summarize(run, out, started=started, stopped_early=stopped_early,
                       resumed_from=resumed_from, param_count=param_count)
  if return_state:
    summary["state"] = jax.device_get(jdist.unreplicate(
        {key: run.state[key] for key in ("params", "model_state", "opt_state")}))
  return summary


def _start(config: TrainConfig) -> tuple[TrainConfig, Any, runlog.RunOutput]:
  """Starts jdist and the run's output; returns (config, topology, output).

  The config comes back with the batch size a restart on another replica
  count needs to keep the checkpoint's global batch (`elastic`).
  """
  topo = jdist.init(timeout=config.timeout,
                    backend=None if config.backend == "auto" else config.backend)
  # Restarted by `jdist launch` on fewer or more replicas: keep the checkpoint's global batch.
  batch_size, restart_note = elastic.restart_batch_size(
      config.checkpoint_dir if config.resume else None, topo.replica_count, config.batch_size)
  config = dataclasses.replace(config, batch_size=batch_size)
  out = runlog.RunOutput(config, topo.is_primary)
  if restart_note:
    out.say(f"note: {restart_note}.")
  return config, topo, out


def _prepare_run(config: TrainConfig, topo, out: runlog.RunOutput) -> tuple[_Run, int]:
  """The run, from its data, program, identical initial state and loaders; and its size.

  Every rank agrees on each part (a failure on one is a failure on all),
  checks that the settings are the same everywhere before any exchange
  they could make differ, and starts from rank 0's parameters. Prints the
  run's one-line description.

  Returns:
    (the run, its parameter count).
  """
  data = _agree(lambda: load_data(config), "dataset", repr(config.dataset))
  input_shape = tuple(data.train_x.shape[1:])
  program = _agree(
      lambda: _program(config.model, data.num_classes, input_shape, config.optimizer_spec,
                       topo),
      "model", repr(config.model))
  # Before any exchange that settings could make differ: the same run everywhere.
  steps_per_epoch = jdist.data.batches_per_epoch(
      len(data.train_x), batch_size=config.batch_size, replica_count=topo.replica_count)
  problem = train_guard.settings_problem(config, data, topo, steps_per_epoch)
  if problem:
    raise TrainError(problem)
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
  run.num_classes = data.num_classes  # for the end's chance-accuracy check
  param_count = models.param_count(params)
  out.say(f"jdist train: {config.model} ({param_count:,} parameters) on "
          f"{data.name} ({len(data.train_x)} train / {len(data.test_x)} test); {topo}; "
          f"batch {config.batch_size} per replica = {config.batch_size * topo.replica_count} "
          f"per step, {run.steps_per_epoch} steps/epoch; {config.optimizer} lr {config.lr:g}; "
          f"{config.optimizer_spec.describe()}")
  return run, param_count


def _train_epochs(run: _Run, config: TrainConfig, out: runlog.RunOutput) -> bool:
  """Trains the remaining epochs, logging each; returns whether --max-steps stopped it early."""
  for epoch in range(run.position["epoch"], config.epochs):
    record = None if reached(config.max_steps, run.step) else run.run_epoch(epoch)
    if record is None:
      return True
    out.record(record)
    out.say(runlog.epoch_line(record, config.epochs))
    if reached(config.max_steps, run.step):
      return epoch + 1 < config.epochs
  return False


def _summarize(run: _Run, out: runlog.RunOutput, *, started: float, stopped_early: bool,
               resumed_from: int | None, param_count: int) -> dict[str, Any]:
  """Writes the run's summary record, closes the log, prints the last line; returns the summary."""
  config, topo = run.config, run.topo
  history = run.position["history"]
  evaluated = [r["test_accuracy"] for r in history if "test_accuracy" in r]
  total_time = time.perf_counter() - started
  summary = {
      "event": "summary", "epochs_completed": len(history), "steps": run.step,
      "final_test_accuracy": evaluated[-1] if evaluated else None,
      "best_test_accuracy": max(evaluated) if evaluated else None,
      "total_time_s": total_time, "stopped_early": stopped_early,
      "resumed_from_step": resumed_from, "param_count": param_count,
      "topology": {"processes": topo.process_count, "local_devices": topo.local_device_count,
                   "replicas": topo.replica_count, "backend": topo.backend},
      "config": config.to_dict(), "epochs": history,
  }
  summary.update(run.guard_fields(final=True))
  out.record(summary)
  out.close()
  final = (f"; final test accuracy {evaluated[-1]:.2%} (best {max(evaluated):.2%})"
           if evaluated else "")
  _say_if_chance(out, config, run, evaluated[-1] if evaluated else None, run.num_classes)
  out.say(f"done: {len(history)} epoch(s), {run.step} steps in {total_time:.1f} s{final}")
  return summary
