"""One training run's loop: epochs, checkpoints, resume, and its guards.

`jdist.app.train.train` builds the program and the data, then hands them to a
`Run`. Every method of `Run` is collective: every process calls it alike.
Besides training, a run makes sure nothing goes silently wrong or gets lost
(see docs/reliability.md, "jdist train's guards"):

  * a state holding NaN or Inf is never checkpointed: the run stops with an
    error (`--on-nonfinite stop`) or rolls back to the last checkpoint and
    goes on past the batches since (`--on-nonfinite rollback`);
  * steps whose loss is not finite (skipped by `--skip-nonfinite`) are left
    out of the epoch's metrics and counted;
  * the replicas are compared by checksum every `--check-replicas-every`
    steps and at the end;
  * under DiLoCo, a training loss that keeps rising across outer syncs is
    said while it happens, naming the outer step's flags; with
    `--diloco-backoff` the outer learning rate is halved and training goes
    on (`train_guard.DivergenceGuard`);
  * a resume with another replica count continues exactly or is refused; an
    unreadable newest checkpoint falls back to an intact older one.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time

import jax
import numpy as np

import jdist
from jdist import consistency
from jdist import errors
from jdist.app import train_guard
from jdist.app.epoch_tally import SUM_KEYS, EpochTally, fresh_position
from jdist.runtime import host
from jdist.app.resume_policy import resume_conflicts
from jdist.transforms.diloco import outer_syncs
from jdist.transforms.diloco import scale_outer_lr

_IN_FLIGHT = 2  # train steps dispatched ahead of the host before it waits
MAX_ROLLBACKS = 3  # --on-nonfinite rollback gives up (stops) after this many


class TrainError(errors.JdistError):
  """The run cannot go on; raised on every process alike, so all exit cleanly."""


def agree(fn, what: str, detail: str = ""):
  """Runs `fn` on every process; if it fails anywhere, raises TrainError everywhere.

  `what` names the exchange, the same on every rank (ranks that disagree on
  it are a diverged run); `detail` (a setting's value, which may differ
  across ranks) only goes in the error.
  """
  described = f"{what} {detail}" if detail else what
  result, problem = None, None
  try:
    result = fn()
  except (ValueError, OSError, errors.JdistError) as err:
    problem = str(err) if str(err) else type(err).__name__

  def train_error(rank: int, problems: list) -> TrainError:
    where = f" (rank {rank})" if len(problems) > 1 and problems[rank] != problem else ""
    return TrainError(f"{described}{where}: {problems[rank]}")

  host.agree(problem, f"jdist train: {what}", train_error)
  return result


def reached(max_steps: int | None, step: int) -> bool:
  return max_steps is not None and step >= max_steps


class Run:
  """One training run's state and its steps; every method is collective."""

  def __init__(self, config, topo, program, state: dict, loaders, out):
    self.config, self.topo, self.program, self.state, self.out = config, topo, program, state, out
    self.train_loader, self.test_loader = loaders
    self.steps_per_epoch = len(self.train_loader)
    self.position = fresh_position()
    # Records from here; written (gathered to rank 0) by the final sync_for_use.
    self.timeline = (jdist.timeline(config.timeline, steps=config.timeline_steps,
                                    function="train_step") if config.timeline else None)
    self.manager, self.synced_at, self.rollbacks = None, -1, 0
    self.local = None  # the local tier (--local-checkpoint-every), or None
    # DiLoCo: the loss across outer syncs, and the outer learning rate as backed off.
    self.guard = (train_guard.DivergenceGuard(config.diloco, repeat=config.diloco_backoff)
                  if config.diloco else None)
    self.outer_lr = config.optimizer_spec.outer_settings()[0] if config.diloco else None
    self.alarms, self.backoffs = 0, 0

  @property
  def step(self) -> int:
    return self.position["step"]

  # Checkpoints and resume ---------------------------------------------------

  def open_checkpoints(self) -> int | None:
    """Sets up checkpointing (both tiers); resumes if asked. Returns the step resumed from."""
    # Here, not at import: the local tier's manager loads orbax, which `--help` must not.
    from jdist.app import checkpoint_tiers as tiers  # pylint: disable=g-import-not-at-top
    config = self.config

    def open_manager():
      if self.topo.is_primary:  # rank 0 writes: find out now, not at the first save
        train_guard.probe_writable(config.checkpoint_dir)
      return jdist.CheckpointManager(config.checkpoint_dir, keep=3)

    self.manager = agree(open_manager, "checkpoint directory")
    if config.local_checkpoint_every:
      local_dir = config.local_checkpoint_dir or tiers.default_local_dir(config.checkpoint_dir)

      def open_local():
        if self.topo.is_primary:
          train_guard.probe_writable(local_dir)
        return tiers.LocalManager(local_dir)

      self.local = agree(open_local, "local checkpoint directory")
    steps = self.manager.all_steps()
    local_steps = tiers.usable_local_steps(self.local) if self.local else []
    if not config.resume or not (steps or local_steps):
      if steps:
        raise TrainError(
            f"{config.checkpoint_dir} already holds checkpoints (latest step {steps[-1]}); "
            f"pass --resume to continue that run, or choose an empty --checkpoint-dir.")
      if config.resume:
        self.out.say(f"no checkpoint in {config.checkpoint_dir} yet: starting from scratch")
      if self.local:
        self.local.drop_after(None)  # an earlier run's: steps start again from 0
      return None
    step = tiers.resume_newest(tiers.resume_order(steps, local_steps),
                               {tiers.PERSISTENT: self.manager, tiers.LOCAL: self.local},
                               self._resume_from, self.out.say)
    if step is not None:
      if self.local:
        self.local.drop_after(step)  # newer local steps (not on every node) are discarded
      return step
    raise TrainError(f"no checkpoint in {config.checkpoint_dir} can be read (steps {steps} "
                     f"were damaged and are set aside as <step>.corrupt). Start a new run "
                     f"with an empty --checkpoint-dir.")

  def _resume_from(self, step: int, manager) -> int:
    config = self.config
    saved = manager.read_metadata(step)["user"]
    saved_config, refusal, note = train_guard.resume_world(saved, config, self.topo)
    if refusal:
      raise TrainError(f"cannot resume from {manager.directory} (step {step}) with "
                       f"{self.topo.replica_count} replicas: {refusal}")
    conflicts, notes = resume_conflicts(saved_config, config)
    if conflicts:
      raise TrainError(
          f"cannot resume from {manager.directory} (step {step}): it belongs to a run "
          f"with other settings: {'; '.join(conflicts)}. Use the checkpoint's settings, or a "
          f"new --checkpoint-dir to start a new run.")
    restored, saved = manager.restore(self.state, step=step)
    self.state.update(restored)
    if note:
      self.out.say(f"note: resuming with a changed setting ({note}).")
    for text in notes:
      self.out.say(f"note: resuming with a changed setting ({text}); the run will differ "
                   f"from an uninterrupted one.")
    self.position.update({k: saved[k] for k in self.position if k in saved})
    self.out.say(f"resumed from {manager.directory} step {step} (epoch "
                 f"{self.position['epoch'] + 1}, batch {self.position['batch_in_epoch']}/"
                 f"{self.steps_per_epoch})")
    return step

  def save(self, epoch: int, batch_in_epoch: int, epoch_so_far: dict, local: bool = False
           ) -> bool:
    """Checkpoints the run (`local`: to the local tier); False (nothing saved) if its
    state was rolled back instead."""
    self.sync_for_use()
    if not self.finite("before saving a checkpoint"):
      return False  # the restored checkpoint is the newest already
    if batch_in_epoch == self.steps_per_epoch:
      epoch, batch_in_epoch, epoch_so_far = epoch + 1, 0, {}
    self.position.update(fresh_position(), **epoch_so_far, epoch=epoch,
                         batch_in_epoch=batch_in_epoch, step=self.step,
                         history=self.position["history"])
    metadata = {**self.position, "seed": self.config.seed, "config": self.config.to_dict(),
                "replica_count": self.topo.replica_count}
    (self.local if local else self.manager).save(self.step, self.state, metadata=metadata)
    if not local:  # `jdist launch` reads it: a restart onto more hosts loses nothing from here
      self.out.say(f"checkpoint saved at step {self.step}")
    return True

  # Guards -------------------------------------------------------------------

  def finite(self, when: str) -> bool:
    """Checks the state for NaN/Inf: True if finite, False if rolled back.

    Raises:
      TrainError: (on every process) non-finite under `--on-nonfinite stop`,
        or with nothing (more) to roll back to.
    """
    parts = {name: self.state[name] for name in ("params", "model_state", "opt_state")}
    bad = host.allgather_object(train_guard.first_nonfinite(parts), "jdist train: finite check")
    bad = next((leaf for leaf in bad if leaf), None)
    if bad is None:
      return True
    config = self.config
    last = self.manager.latest_step() if self.manager else None
    rollback = config.on_nonfinite == "rollback"
    if rollback and last is not None and self.rollbacks < MAX_ROLLBACKS:
      self.rollbacks += 1
      restored, _ = self.manager.restore(self.state, step=last)
      self.state.update(restored)  # in place: the running epoch holds this dict
      self.out.say(f"warning: step {self.step}: the training state holds NaN or Inf (first: "
                   f"{bad}); rolled back to checkpoint step {last} (rollback "
                   f"{self.rollbacks} of {MAX_ROLLBACKS}); training goes on from the current "
                   f"batch, past the batches since step {last}.")
      self.out.record({"event": "rollback", "step": self.step, "to_step": last, "leaf": bad})
      return False
    kept = (f"; nothing was saved over the newest checkpoint, step {last} in "
            f"{config.checkpoint_dir}, which is finite" if last is not None else
            "; it was not saved")
    if rollback:
      how = (f"rolled back {MAX_ROLLBACKS} times already" if last is not None else
             "there is no checkpoint to roll back to yet")
      fix = f"--on-nonfinite rollback gives up: {how}. Lower --lr, or use --skip-nonfinite"
    else:
      fix = ("Lower --lr, use --skip-nonfinite (skips steps with non-finite gradients), or "
             "--on-nonfinite rollback (goes back to the last checkpoint)")
    if config.diloco:
      fix = (f"Under DiLoCo the outer step is the likely cause: lower --diloco-outer-lr "
             f"(now {self.outer_lr:g}) or --diloco-outer-momentum, or add --diloco-backoff. "
             f"{fix}")
    raise TrainError(f"step {self.step} ({when}): the training state holds NaN or Inf (first "
                     f"non-finite leaf: {bad}), so the run stops{kept}. {fix}.")

  def check_replicas(self) -> None:
    problem = train_guard.replicas_problem(
        {"params": self.state["params"], "model_state": self.state["model_state"]}, self.step)
    if problem:
      raise consistency.ReplicaMismatchError(problem)

  def sync_for_use(self, final: bool = False) -> None:
    """Makes the replicas' parameters one model where the mode lets them differ.

    Under partial sync, averages them before they are evaluated or saved.
    Under diloco and local SGD, whose checkpoints keep every replica's own
    copy (a resume continues exactly), only at the end of training (`final`):
    the model handed back is the replicas' mean.
    """
    if final and self.timeline is not None:
      path = self.timeline.close()
      self.timeline = None
      if path:
        self.out.say(f"timeline: {path} (open it in ui.perfetto.dev, or run `jdist timeline "
                     f"summarize {path}`)")
    if not final and (self.config.diloco or self.config.local_sgd):
      return
    if self.config.local_updates and self.synced_at != self.step:
      self.state["params"] = jdist.sync_params(self.state["params"])
      self.synced_at = self.step
      if self.config.check_replicas_every:
        self.check_replicas()

  def skipped_total(self) -> int | None:
    if not self.config.skip_nonfinite:
      return None
    return int(np.asarray(jax.device_get(self.state["opt_state"].skipped))[0])

  # Training -----------------------------------------------------------------

  def evaluate(self) -> dict:
    """Test metrics; under diloco and local SGD, of the replicas' mean parameters."""
    self.sync_for_use()
    params = self.state["params"]
    if self.config.diloco or self.config.local_sgd:
      params = jdist.sync_params(params)  # a copy: training goes on from the local ones
    accumulator = jdist.MetricAccumulator()
    with contextlib.closing(self.test_loader.epoch(0)) as batches:
      for batch in batches:
        accumulator.add(self.program.eval_step(params, self.state["model_state"], batch))
    return accumulator.result()

  def run_epoch(self, epoch: int) -> dict | None:
    """Trains one epoch (or its rest); returns its record, or None if stopped early."""
    config, state, position = self.config, self.state, self.position
    resuming = epoch == position["epoch"] and position["batch_in_epoch"] > 0
    batch_index = position["batch_in_epoch"] if resuming else 0
    tally = EpochTally(position if resuming else fresh_position())
    if tally.skipped_before is None:
      tally.skipped_before = self.skipped_total()
    first_batch, epoch_start, in_flight, saved_at = batch_index, time.perf_counter(), \
        collections.deque(), None

    def so_far() -> dict:
      while in_flight:
        self._take(tally, *in_flight.popleft(), None)
      return tally.position(time.perf_counter() - epoch_start)

    with self.out.bar(epoch, self.steps_per_epoch, batch_index) as bar, \
         contextlib.closing(self.train_loader.epoch(epoch, batch_index)) as batches:
      for batch in batches:
        (state["params"], state["model_state"], state["opt_state"], sums,
         wire) = self.program.train_step(state["params"], state["model_state"],
                                         state["opt_state"], batch)
        if self.timeline is not None:  # the step's compression ratio and residual norm
          self.timeline.observe(state["opt_state"], state["params"])
        position["step"] += 1
        batch_index += 1
        tally.wires.append(wire)
        # Bound the steps queued ahead: a steady pipeline, and a bar showing real progress.
        in_flight.append((self.step, sums))
        if len(in_flight) > _IN_FLIGHT and not self._take(tally, *in_flight.popleft(), bar):
          # A non-finite loss: the state is checked (every rank saw the same sums).
          if not self.finite("after a non-finite loss"):
            in_flight.clear()
            tally.restart(self.skipped_total())
            first_batch, epoch_start = batch_index, time.perf_counter()
        every = config.check_replicas_every
        if every and not config.local_updates and self.step % every == 0:
          self.check_replicas()
        if (config.checkpoint_every and self.step % config.checkpoint_every == 0
            and batch_index < self.steps_per_epoch):
          if self.save(epoch, batch_index, so_far()):
            saved_at = self.step
          else:
            tally.restart(self.skipped_total())
            first_batch, epoch_start = batch_index, time.perf_counter()
        elif (self.local and self.step % config.local_checkpoint_every == 0
              and batch_index < self.steps_per_epoch):
          if not self.save(epoch, batch_index, so_far(), local=True):
            tally.restart(self.skipped_total())
            first_batch, epoch_start = batch_index, time.perf_counter()
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
    if not self.finite("at the end of the epoch"):
      tally.restart(self.skipped_total())
      done = tally.position(0.0)
    record = self._epoch_record(epoch, tally, done, self.steps_per_epoch - first_batch,
                                epoch_start)
    self._evaluate_into(record, epoch)
    self.position["history"].append(record)
    if self.manager:
      self.save(epoch, self.steps_per_epoch, {})
    return record

  def _epoch_record(self, epoch: int, tally: EpochTally, done: dict, steps_timed: int,
                    epoch_start: float) -> dict:
    """The finished epoch's training record, without evaluation.

    The tally's record plus throughput (over the `steps_timed` steps since
    `epoch_start`), bytes on the wire per step, and where they apply: outer
    syncs so far, skipped steps, rollbacks.
    """
    config = self.config
    record = tally.record(epoch, self.step, done)
    record["samples_per_s"] = (steps_timed * config.batch_size * self.topo.replica_count
                               / max(time.perf_counter() - epoch_start, 1e-9))
    record["wire_bytes_per_step"] = done["epoch_wire"] / self.steps_per_epoch
    if config.diloco or config.local_sgd:  # syncs so far (fragment exchanges, averagings)
      syncs = jax.device_get(outer_syncs(self.state["opt_state"]))
      record["outer_syncs"] = int(np.asarray(syncs).reshape(-1)[0])
    if config.skip_nonfinite:
      total = self.skipped_total()
      record["skipped_steps"] = total - (tally.skipped_before or 0)
      record["skipped_steps_total"] = total
    if self.rollbacks:
      record["rollbacks_total"] = self.rollbacks
    record.update(self.guard_fields())
    return record

  def _evaluate_into(self, record: dict, epoch: int) -> None:
    """Adds the test metrics to `record` if `epoch` is due (every --eval-every, and the last).

    Sets `eval_time_s` and `epoch_time_s` (training plus evaluation) either way.
    """
    config = self.config
    eval_start = time.perf_counter()
    last = epoch + 1 == config.epochs or reached(config.max_steps, self.step)
    if config.eval_every and ((epoch + 1) % config.eval_every == 0 or last):
      result = self.evaluate()
      record.update(test_loss=result["loss"], test_accuracy=result["accuracy"],
                    test_examples=result["count"])
    record["eval_time_s"] = time.perf_counter() - eval_start
    record["epoch_time_s"] = record["train_time_s"] + record["eval_time_s"]

  def _take(self, tally: EpochTally, step: int, sums, bar) -> bool:
    """Adds step `step`'s sums to the epoch (False, and left out, if its loss is not finite)."""
    host_sums = {k: float(np.asarray(v)[0]) for k, v in jax.device_get(sums).items()}
    finite = math.isfinite(host_sums["loss_sum"])
    if finite:
      for key in SUM_KEYS:
        tally.sums[key] = tally.sums.get(key, 0.0) + host_sums[key]
      if self.guard is not None:
        self._watch(step, host_sums)
    else:
      tally.nonfinite += 1
    if bar is not None:
      bar.update(1)
      if finite and host_sums["weight_sum"]:
        bar.set_postfix(loss=f"{host_sums['loss_sum'] / host_sums['weight_sum']:.4f}",
                        refresh=False)
    return finite

  def guard_fields(self, final: bool = False) -> dict:
    """DiLoCo's divergence guard in a record: after a warning (`final`: always, for the summary)."""
    if final and self.config.diloco:
      return {"diverging_warnings": self.alarms, "outer_lr_backoffs": self.backoffs,
              "final_outer_lr": self.outer_lr}
    if final or not self.alarms:
      return {}
    return {"diverging_warnings_total": self.alarms, "outer_lr": self.outer_lr}

  def _watch(self, step: int, sums: dict) -> None:
    """DiLoCo: warns when the loss rises across outer syncs; backs off if asked.

    Every process reads the same loss sums, so every process acts alike: the
    halved learning rate (in the state, `scale_outer_lr`) applies from the
    next step dispatched.
    """
    guard = self.guard
    if not guard.observe(step, sums["loss_sum"], sums["weight_sum"]):
      return
    self.alarms += 1
    seen = (f"the mean training loss of the last {guard.window} outer periods "
            f"({self.config.diloco} steps each) was above {guard.threshold():.4f} at "
            f"{guard.patience} syncs in a row (lowest such mean so far {guard.lowest:.4f}, "
            f"last {guard.last_mean:.4f})")
    if self.config.diloco_backoff:
      self.state["opt_state"] = scale_outer_lr(self.state["opt_state"], 0.5)
      self.backoffs += 1
      self.outer_lr /= 2
      action = (f"--diloco-backoff: outer lr halved to {self.outer_lr:g} (outer momentum "
                f"cleared), training goes on; a next run can start there with "
                f"--diloco-outer-lr {self.outer_lr:g}")
    else:
      momentum = self.config.optimizer_spec.outer_settings()[1]
      action = (f"the outer step is likely too large for this inner optimizer: rerun with a "
                f"smaller --diloco-outer-lr (now {self.outer_lr:g}; e.g. "
                f"{self.outer_lr / 2:g}) or --diloco-outer-momentum (now {momentum:g}), or "
                f"add --diloco-backoff to halve the outer lr while training")
    self.out.say(f"warning: step {step}: DiLoCo's training loss is rising across outer "
                 f"syncs: {seen}; {action}.")
    self.out.record({"event": "diverging", "step": step, "window_loss": guard.last_mean,
                     "lowest_window_loss": guard.lowest, "outer_lr": self.outer_lr,
                     "backed_off": bool(self.config.diloco_backoff)})
