"""`jdist train --shrink`: a run that loses processes and keeps training.

Launched by `jdist launch --shrink` (mpirun with Open MPI's ULFM on and its
TCP transport). When a process dies, the survivors see `PeerLost` in the
step's gradient exchange, shrink the communicator
(`jdist.collectives.shrinkable`), go back to the last state they all
agreed on (an agreement every `CONFIRM_EVERY` steps and at every epoch's
end), and go on from there with the state they hold in memory: no
process restarts, no checkpoint is read.

With `jdist launch --shrink --max-np N`, the job also grows back: at the
next step boundary after a shrink, the survivors start new processes (on
the lost ones' hosts, `MPI_Comm_spawn`) up to N and train on while those
start, load the data and compile the step; at the first step boundary
after they said they are ready, the survivors take them in and rank 0
hands them the state it holds; no checkpoint is read. With `--min-np M`, a job left with
fewer than M processes that cannot grow stops with a message.

What stays the same across a shrink (and a growth):
  * the global batch (`--batch-size` x the launch's process count): step s
    of an epoch takes the same examples, split over however many replicas
    are left, so no example is skipped or doubled within an epoch;
  * the replicas: each applies the same summed gradient, so they stay
    bit-identical;
  * the gradient: a sum over the global batch divided by its size, the same
    whatever the replica count (up to the order of float additions).

What this mode gives up, for now (docs/multinode.md, "Shrinking"): JAX's
distributed runtime is not started (a dead process would end the others,
and process 0 is its coordinator), so `jax.process_index()` is 0 everywhere;
one device per process; the gradient crosses processes on the host (numpy
over MPI), not in the step; no DiLoCo, compression or guards. A process
that waits in MPI past `--timeout` leaves (`shrinkable.StallGuard`): a death
MPI does not see (a process killed while it was being started) becomes one
it does.

With `--checkpoint-dir`, the live rank 0 also saves agreed states
(`jdist.app.shrink_checkpoints`), for the losses a shrink cannot survive: a
lost node ends the whole job (PRRTE 3.0), and `jdist launch --shrink
--max-restarts N` starts it again on the healthy hosts with `--resume`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from jdist import errors
from jdist.app import datasets
from jdist.app import launch_shrink
from jdist.app import models
from jdist.app import shrink_checkpoints
from jdist.app import supervise
from jdist.app import train as train_lib
from jdist.app import train_guard
from jdist.app.config import TrainConfig
from jdist.collectives import shrinkable
from jdist.runtime import abort
from jdist.runtime import topology

# The TrainConfig fields this mode reads; any other one set away from its
# default is refused (it would be silently ignored).
HONORED = ("model", "dataset", "data_dir", "download", "epochs", "batch_size",
           "eval_batch_size", "seed", "train_limit", "test_limit", "log_file", "progress",
           "optimizer", "lr", "momentum", "weight_decay", "timeout", "backend",
           "checkpoint_dir", "checkpoint_every", "resume")


# Steps between agreements that no member failed (`ShrinkableComm.confirm`). ULFM's
# agreement costs two round trips (8 ms on the rig's 1 Gbit/s link, against the
# exchange's 24 ms; 4 ms without ULFM), so it is paid once per window; a loss
# rolls the survivors back to the window's start (at most 7 steps taken again).
CONFIRM_EVERY = 8


class ShrinkModeError(ValueError):
  """A `jdist train --shrink` setting this mode cannot honor."""


class Snapshot(NamedTuple):
  """A replica's state after `step` completed steps, with its epoch's tallies so far."""
  step: int
  params: Any
  model_state: Any
  opt_state: Any
  tally: np.ndarray  # [loss sum, correct, examples] of the epoch so far


class Program(NamedTuple):
  """The compiled pieces of one run: gradients, the update, evaluation."""
  init: Callable
  opt_init: Callable
  grads: Callable  # (params, state, x, y, weight, global_batch) -> grads, state, loss, correct
  apply: Callable  # (params, opt_state, grads) -> params, opt_state
  evaluate: Callable  # (params, state, x, y, weight) -> loss sum, correct


GROW_WAIT_S = 120.0  # how long started processes may take to get ready, without --timeout


class Growth(NamedTuple):
  """How many processes the job may run on (`jdist launch --shrink --min-np/--max-np`).

  Attributes:
    min_np: below this many processes (and no growth possible), the run stops.
    max_np: grow back to this many processes after a shrink (0: never grow).
    command: the argv that new processes run (this process's own).
  """
  min_np: int = 1
  max_np: int = 0
  command: tuple[str, ...] = ()

  @classmethod
  def from_environment(cls) -> "Growth":
    """Read from the environment `jdist launch --shrink` gives the job."""
    return cls(int(os.environ.get(launch_shrink.MIN_NP_ENV, "1")),
               int(os.environ.get(launch_shrink.MAX_NP_ENV, "0")),
               (sys.executable, *sys.orig_argv[1:]))


class TooFewProcesses(errors.JdistError):
  """Fewer processes are left than `--min-np`, and none can be started."""


class Pending(NamedTuple):
  """A shrink whose first completed step has not come yet."""
  lost_ranks: tuple[int, ...]
  lost_hosts: tuple[str, ...]
  detected_at: float
  digests_equal: bool  # the survivors' parameters, bit for bit, once they agreed on the step


def check_config(config: TrainConfig) -> None:
  """Raises ShrinkModeError for settings `--shrink` does not honor."""
  defaults = TrainConfig()
  ignored = [field.name for field in dataclasses.fields(TrainConfig)
             if field.name not in HONORED
             and getattr(config, field.name) != getattr(defaults, field.name)]
  if config.cpu_devices not in (None, 1):
    ignored.append("cpu_devices")
  if ignored:
    flags = ", ".join("--" + name.replace("_", "-") for name in sorted(set(ignored)))
    raise ShrinkModeError(f"--shrink does not support {flags} (it trains one device per "
                          f"process, with plain SGD/Adam/AdamW).")
  if config.optimizer not in ("sgd", "adam", "adamw"):
    raise ShrinkModeError(f"--shrink: --optimizer {config.optimizer} is not supported.")


def build_program(config: TrainConfig, num_classes: int, input_shape: tuple) -> Program:
  """The run's jitted functions, for one device of this process."""
  model = models.create_model(config.model, num_classes=num_classes, input_shape=input_shape)
  tx = config.optimizer_spec.inner()  # the gradient is already summed over replicas

  def init(seed):
    key = jax.random.key(seed, impl="rbg")
    variables = dict(model.init(key, jnp.zeros((1, *input_shape), jnp.float32), train=False))
    return variables.pop("params"), variables

  def grads(params, state, x, y, weight, global_batch):
    def loss_fn(p):
      logits, new_state = models.apply_model(model, p, state, x, train=True)
      losses = models.example_losses(logits, y) * weight
      correct = models.example_correct(logits, y) * weight
      return jnp.sum(losses) / global_batch, (jnp.sum(losses), jnp.sum(correct), new_state)
    gradient, (loss, correct, new_state) = jax.grad(loss_fn, has_aux=True)(params)
    return gradient, new_state, loss, correct

  def apply(params, opt_state, gradient):
    updates, opt_state = tx.update(gradient, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def evaluate(params, state, x, y, weight):
    logits, _ = models.apply_model(model, params, state, x, train=False)
    return (jnp.sum(models.example_losses(logits, y) * weight),
            jnp.sum(models.example_correct(logits, y) * weight))

  return Program(jax.jit(init), jax.jit(tx.init), jax.jit(grads), jax.jit(apply),
                 jax.jit(evaluate))


def replica_slice(indices: np.ndarray, replica: int, replicas: int,
                  size: int) -> tuple[np.ndarray, np.ndarray]:
  """This replica's part of a global batch as [chunks, size] indices and weights.

  The batch is split in `replicas` contiguous parts (np.array_split); a part
  is padded (its first example, at weight 0) to whole chunks of `size`, so
  that every replica count runs the shape that was compiled at the start:
  a shrink costs no compilation, only more chunks per replica.
  """
  part = np.array_split(indices, replicas)[replica]
  chunks = max(1, math.ceil(len(part) / size))
  weight = np.zeros(chunks * size, np.float32)
  weight[:len(part)] = 1.0
  padded = np.concatenate([part, np.full(chunks * size - len(part), indices[0], indices.dtype)])
  return padded.reshape(chunks, size), weight.reshape(chunks, size)


class Output:
  """The current rank 0's voice (it changes when rank 0 is lost): lines and the JSON log."""

  def __init__(self, config: TrainConfig):
    self.config, self._log = config, None

  def say(self, primary: bool, text: str) -> None:
    if primary:
      print(text, flush=True)

  def record(self, primary: bool, record: dict) -> None:
    if not (primary and self.config.log_file):
      return
    if self._log is None:  # appended to: a new rank 0 goes on with the lost one's file
      os.makedirs(os.path.dirname(os.path.abspath(self.config.log_file)), exist_ok=True)
      self._log = open(self.config.log_file, "a", encoding="utf-8")
    self._log.write(json.dumps(record) + "\n")
    self._log.flush()


class ShrinkRun:
  """One `--shrink` training run; every method is collective over the live processes."""

  def __init__(self, config: TrainConfig, data: datasets.Dataset, comm, on_step=None,
               growth: Growth = Growth(), global_batch: int | None = None,
               checkpoints: shrink_checkpoints.ShrinkCheckpoints | None = None,
               program: Program | None = None):
    self.config, self.data, self.comm, self.growth = config, data, comm, growth
    self.checkpoints = checkpoints
    self.on_step = on_step or (lambda step, rank, replicas: None)  # fault drills (tests)
    self.global_batch = global_batch or config.batch_size * comm.size  # the launch's, kept
    self.steps_per_epoch = len(data.train_x) // self.global_batch
    if not self.steps_per_epoch:
      raise ShrinkModeError(f"the training set ({len(data.train_x)} examples) is smaller "
                            f"than one global batch ({self.global_batch})")
    self.total_steps = self.steps_per_epoch * config.epochs
    self.program = program or build_program(config, data.num_classes, data.train_x.shape[1:])
    self.out = Output(config)
    self.shrinks: list[dict] = []
    self.grows: list[dict] = []
    self.grow_after: int | None = None  # after a failed growth: the step to try again at
    self.starting: tuple[shrinkable.Starting, float] | None = None  # started, and when (wall)
    self.grow_wait_s = shrinkable.STALLS.deadline_s or GROW_WAIT_S  # --timeout

  @property
  def primary(self) -> bool:
    return self.comm.rank == 0

  def start(self, resume_step: int | None = None) -> Snapshot:
    """Rank 0's initial parameters on every replica (as `jdist train` does), or a checkpoint's."""
    if resume_step is not None:
      saved = self.checkpoints.restore(resume_step, self._saved(self._fresh()))
      # As a fresh start's arrays (uncommitted), not orbax's (committed to a
      # device): the step's compiled program, in JAX's cache since the run
      # before the restart, is then found there instead of compiled again.
      fresh = lambda tree: jax.tree.map(lambda leaf: jnp.asarray(np.asarray(leaf)), tree)
      self.out.say(self.primary, f"jdist train --shrink: resumed from step {resume_step} of "
                   f"{self.checkpoints.directory}")
      return Snapshot(resume_step, fresh(saved["params"]), fresh(saved["model_state"]),
                      fresh(saved["opt_state"]), np.asarray(saved["tally"]))
    params, state = self.program.init(self.config.seed)
    flat, unravel = ravel_pytree((params, state))
    params, state = unravel(jnp.asarray(self.comm.bcast(np.array(flat))))
    return Snapshot(0, params, state, self.program.opt_init(params), np.zeros(3))

  def share(self, now: Snapshot | None) -> tuple[Snapshot, bool]:
    """Rank 0's state on every member, the ones `start_growth()` started included (they pass None).

    Returns:
      The state, and whether every member's parameters are then bit-identical.
    """
    if now is None:  # a new process: the structure of the state, to receive into
      now = self._fresh()
    leaves, treedef = jax.tree.flatten((now.params, now.model_state, now.opt_state))
    payload = (now.step, [np.asarray(x) for x in leaves], now.tally) if self.primary else None
    step, leaves, tally = self.comm.bcast_object(payload)
    params, state, opt_state = jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves])
    now = Snapshot(step, params, state, opt_state, np.asarray(tally))
    return now, self.digests_equal(now)

  def digests_equal(self, now: Snapshot) -> bool:
    """Whether every replica holds the same parameters, bit for bit (collective)."""
    return len(set(self.comm.allgather_object(params_digest(now.params)))) == 1

  def can_grow(self, step: int) -> bool:
    """Whether to start processes before step `step` (after a shrink, or a failed try)."""
    return (self.comm.size < self.growth.max_np
            and (self.grow_after is None or step >= self.grow_after))

  def start_growth(self) -> None:
    """Starts processes up to `--max-np` on the lost ones' hosts (collective); they prepare.

    Raises:
      shrinkable.PeerLost: a member failed meanwhile.
      shrinkable.GrowFailed: none could be started; the job goes on as it was.
    """
    started = time.time()
    lost_hosts = tuple(sorted({self.comm.hosts[rank] for rank in
                               set(self.comm.hosts) - set(self.comm.members)}))
    self.starting = (self.comm.start_growth(self.growth.max_np - self.comm.size,
                                            list(self.growth.command), lost_hosts), started)

  def growth_ready(self) -> bool:
    """Whether the started processes are ready to be taken in (collective, the same everywhere).

    Past `grow_wait_s` (`--timeout`) they are given up on (one died while
    starting, which MPI does not report) and others are started at the
    next step boundary.

    Raises:
      shrinkable.PeerLost: a member failed meanwhile.
    """
    starting, _ = self.starting
    waited = time.monotonic() - starting.began
    verdict = self.comm.growth_verdict(starting, give_up=waited > self.grow_wait_s)
    if verdict == shrinkable.GIVE_UP:
      self.starting = None
      self.out.say(self.primary, f"jdist train: grow: the started process(es) were not ready "
                   f"within {self.grow_wait_s:g} s (one may have died while starting); "
                   f"starting others")
    return verdict == shrinkable.READY

  def take_in(self, now: Snapshot) -> Snapshot:
    """Takes the ready processes in and hands them the state (collective with them).

    Raises:
      shrinkable.PeerLost: a member failed meanwhile.
      shrinkable.GrowFailed: a started process failed in the merge.
    """
    (starting, started), self.starting = self.starting, None
    ready = time.time()
    grown = self.comm.take_in(starting)
    self.comm.bcast_object(self.global_batch)  # what `joined` reads first
    now, equal = self.share(now)
    event = {"event": "grow", "new_ranks": list(grown.new_ranks), "replicas": grown.size,
             "started_at": started, "ready_at": ready, "joined_at": time.time(),
             "step": now.step, "digests_equal": equal}
    self._log(self.grows, event, f"jdist train: grow: rank(s) {list(grown.new_ranks)} joined "
              f"at step {now.step}; {grown.size} replicas, {event['joined_at'] - started:.2f} s "
              f"after they were started ({event['joined_at'] - ready:.2f} s of it the "
              f"members' to take them in)")
    return now

  def _log(self, events: list[dict], event: dict, line: str) -> None:
    """Keeps `event`, writes it to the JSON log and says `line` (rank 0)."""
    events.append(event)
    self.out.record(self.primary, event)
    self.out.say(self.primary, line)

  def _fresh(self) -> Snapshot:
    """This process's own initial state: the structure a received or restored one fills."""
    params, state = self.program.init(self.config.seed)
    return Snapshot(0, params, state, self.program.opt_init(params), np.zeros(3))

  @staticmethod
  def _saved(now: Snapshot) -> dict[str, Any]:
    return {"params": now.params, "model_state": now.model_state, "opt_state": now.opt_state,
            "tally": np.asarray(now.tally)}

  def checkpoint(self, now: Snapshot, epoch_end: bool) -> None:
    """Saves an agreed state when one is due (the live rank 0 writes; nobody waits)."""
    if self.checkpoints is not None and self.checkpoints.due(now.step, epoch_end):
      self.checkpoints.save(now.step, self._saved(now), self.global_batch, self.primary)

  def batch_indices(self, step: int) -> np.ndarray:
    """The global batch of global step `step`: the same whatever the replica count."""
    epoch, within = divmod(step, self.steps_per_epoch)
    order = np.random.default_rng((self.config.seed, epoch)).permutation(len(self.data.train_x))
    return order[within * self.global_batch:(within + 1) * self.global_batch]

  def confirms(self, step: int) -> bool:
    """Whether the step that completes `step` steps ends with an agreement.

    The end of every `CONFIRM_EVERY` steps and of every epoch: an epoch's
    record and evaluation come from a state every member agreed on.
    """
    return (step % CONFIRM_EVERY == 0 or step % self.steps_per_epoch == 0
            or step == self.total_steps)

  def train_step(self, now: Snapshot) -> Snapshot:
    """One step on the live replicas. Raises shrinkable.PeerLost.

    An allreduce cut short by a death may return wrong sums, so the result
    counts only once a later `confirm()` passed (`confirms`): the caller
    keeps the last confirmed state to go back to.
    """
    self.on_step(now.step, self.comm.launch_rank, self.comm.size)
    chunks, weights = replica_slice(self.batch_indices(now.step), self.comm.rank,
                                    self.comm.size, self.config.batch_size)
    summed, sums, state = 0.0, np.zeros(2), now.model_state
    for mine, weight in zip(chunks, weights):  # summed on the host: nothing new to compile
      part, state, loss, correct = self.program.grads(
          now.params, now.model_state, self.data.train_x[mine], self.data.train_y[mine],
          weight, float(self.global_batch))
      flat_grad, unravel_grad = ravel_pytree(part)
      summed = summed + np.asarray(flat_grad, np.float64)
      sums += [float(loss), float(correct)]
    # BatchNorm statistics (if any): the mean of the replicas' (of their last chunk).
    flat_state, unravel_state = ravel_pytree(state)
    local = np.concatenate([summed, np.asarray(flat_state, np.float64) / self.comm.size,
                            sums, [weights.sum()]])
    total = self.comm.sum(local)
    if self.confirms(now.step + 1):
      self.comm.confirm()
    gradient = unravel_grad(jnp.asarray(total[:summed.size], flat_grad.dtype))
    state = unravel_state(jnp.asarray(total[summed.size:-3], flat_state.dtype))
    params, opt_state = self.program.apply(now.params, now.opt_state, gradient)
    tally = now.tally + total[-3:]
    return Snapshot(now.step + 1, params, state, opt_state, tally)

  def evaluate(self, now: Snapshot) -> tuple[float, float]:
    """Test loss and accuracy, every test example once over the live replicas."""
    size = self.config.eval_batch
    order = np.arange(len(self.data.test_x))
    sums = np.zeros(2)
    for begin in range(0, len(order), size * self.comm.size):
      chunk = order[begin:begin + size * self.comm.size]
      for mine, weight in zip(*replica_slice(chunk, self.comm.rank, self.comm.size, size)):
        loss, correct = self.program.evaluate(now.params, now.model_state,
                                              self.data.test_x[mine], self.data.test_y[mine],
                                              weight)
        sums += [float(loss), float(correct)]
    total = self.comm.sum(sums)
    self.comm.confirm()
    return total[0] / len(order), total[1] / len(order)

  def end_epoch(self, now: Snapshot, started: float) -> Snapshot:
    """Evaluates, says and logs the epoch that `now` completed; resets the tallies."""
    epoch = now.step // self.steps_per_epoch
    test_loss, test_accuracy = self.evaluate(now)
    loss, correct, examples = now.tally
    record = {"event": "epoch", "epoch": epoch, "train_loss": loss / examples,
              "train_accuracy": correct / examples, "test_loss": test_loss,
              "test_accuracy": test_accuracy, "replicas": self.comm.size,
              "epoch_time_s": time.time() - started}
    self.out.say(self.primary, f"epoch {epoch}/{self.config.epochs}: train loss "
                 f"{record['train_loss']:.4f} acc {record['train_accuracy']:.2%} | test loss "
                 f"{test_loss:.4f} acc {test_accuracy:.2%} | {self.comm.size} replicas")
    self.out.record(self.primary, record)
    return now._replace(tally=np.zeros(3))

  def recover(self, now: Snapshot, pending: Pending | None) -> tuple[Snapshot, Pending]:
    """Shrinks to the survivors and returns the state they all hold, and the shrink.

    Args:
      now: this process's last confirmed state (every survivor holds the same:
        the agreement is uniform); the steps after it are taken again.
      pending: the shrink not yet logged, if another loss came before its step.
    """
    detected = time.time()
    shrunk = self.comm.shrink()
    agreed = self.comm.minimum(np.array([now.step, -now.step, detected]))
    step, detected = int(agreed[0]), float(agreed[2])
    if step != -int(agreed[1]):
      raise shrinkable.PeerLost(f"the survivors' last agreed steps differ ({step} to "
                                f"{-int(agreed[1])})")
    lost_ranks = (pending.lost_ranks if pending else ()) + shrunk.lost_ranks
    lost_hosts = tuple(sorted(set((pending.lost_hosts if pending else ()) + shrunk.lost_hosts)))
    if pending:
      detected = pending.detected_at
    self.out.say(self.primary, f"jdist train: shrink: lost rank(s) {list(shrunk.lost_ranks)} "
                 f"on {', '.join(shrunk.lost_hosts)}; going on with {shrunk.size} replicas "
                 f"from step {step}")
    equal = self.digests_equal(now) and (pending is None or pending.digests_equal)
    return now, Pending(lost_ranks, lost_hosts, detected, equal)

  def resumed(self, pending: Pending, now: Snapshot) -> None:
    """Logs a shrink once the survivors completed their first step after it."""
    event = {"event": "shrink", "lost_ranks": list(pending.lost_ranks),
             "lost_hosts": list(pending.lost_hosts), "replicas": self.comm.size,
             "detected_at": pending.detected_at, "resumed_at": time.time(), "step": now.step,
             "digests_equal": pending.digests_equal}
    self._log(self.shrinks, event, f"jdist train: shrink: resumed at step {now.step} on "
              f"{self.comm.size} replicas, {event['resumed_at'] - event['detected_at']:.2f} s "
              f"after the loss was detected")

  def first_step_after_restart(self, now: Snapshot, resume_step: int) -> None:
    """Logs the first step a restarted job completed (what a restart cost ends with)."""
    event = {"event": "restart", "resumed_from": resume_step, "step": now.step,
             "replicas": self.comm.size, "first_step_at": time.time()}
    self.out.record(self.primary, event)
    self.out.say(self.primary, f"jdist train --shrink: first step after the restart done "
                 f"(step {now.step}, {self.comm.size} replicas)")

  def run(self, joined: Snapshot | None = None, resume_step: int | None = None) -> dict:
    """Trains every epoch, shrinking past lost processes; returns the summary record.

    A loss rolls the survivors back to their last agreed state (`confirms`).
    A loss during an epoch's evaluation (or the final one) is shrunk past
    like one during a step: the survivors evaluate again, so every epoch is
    logged once, and a shrink is logged once they completed their next step
    or evaluation. After a shrink, the job starts processes to grow back
    (`Growth.max_np`) at the next step boundary and takes them in at the
    first step boundary after they are ready.

    Args:
      joined: in a process that `start_growth()` started, the state it was handed.
      resume_step: the checkpoint to start from (`jdist launch --max-restarts`).
    """
    began = epoch_began = time.time()
    now = confirmed = joined or self.start(resume_step)
    pending, due, final = None, False, None  # growth happens only where no evaluation is due
    restarted = joined is None and resume_step is not None
    while final is None:
      try:
        boundary = not due and now.step < self.total_steps  # before a step: growth's place
        if boundary and self.starting is None and self.can_grow(now.step):
          self.start_growth()
        if boundary and self.starting is not None and self.growth_ready():
          now = confirmed = self.take_in(now)
          continue
        if self.comm.size < self.growth.min_np:
          raise TooFewProcesses(f"{self.comm.size} process(es) left, fewer than --min-np "
                                f"{self.growth.min_np}, and none can be started")
        if not due and now.step < self.total_steps:
          now = self.train_step(now)
          if restarted:
            self.first_step_after_restart(now, resume_step)
            restarted = False
          confirmed = now if self.confirms(now.step) else confirmed
          due = now.step % self.steps_per_epoch == 0
          if confirmed is now and not due:
            self.checkpoint(now, epoch_end=False)
        elif due:
          now, due, epoch_began = self.end_epoch(now, epoch_began), False, time.time()
          confirmed = now
          self.checkpoint(now, epoch_end=True)
        else:
          final = self.evaluate(now)
        if pending:
          self.resumed(pending, now)
          pending = None
      except shrinkable.PeerLost:
        now, pending = self.recover(confirmed, pending)
        if self.starting is not None:  # started beside a member now lost: start others
          self.comm.dismiss(self.starting[0])
          self.starting = None
        confirmed = now
        due = due and now.step % self.steps_per_epoch == 0  # else its steps are taken again
      except shrinkable.GrowFailed as err:
        # At every member alike (the start failed, not a member): try again
        # at the next epoch, not before every step.
        self.grow_after = (now.step // self.steps_per_epoch + 1) * self.steps_per_epoch
        self.out.say(self.primary, f"jdist train: grow: {err}; going on with "
                     f"{self.comm.size} replicas (trying again at step {self.grow_after})")
    if self.starting is not None:  # started too late to take part: sent away
      self.comm.dismiss(self.starting[0])
      self.starting = None
    test_loss, test_accuracy = final
    equal = self.digests_equal(now)  # every replica's final parameters, bit for bit
    summary = {"event": "summary", "steps": now.step, "replicas": self.comm.size,
               "digests_equal": equal,
               "test_loss": test_loss, "test_accuracy": test_accuracy,
               "shrinks": len(self.shrinks), "grows": len(self.grows),
               "launch_rank": self.comm.launch_rank, "wall_time_s": time.time() - began,
               "params_digest": params_digest(now.params)}
    self.out.record(self.primary, summary)
    self.out.say(self.primary, f"{supervise.SHRINK_FINISHED}: {now.step} steps, final test accuracy "
                 f"{test_accuracy:.2%} on {self.comm.size} replicas ({len(self.shrinks)} shrinks, "
                 f"{len(self.grows)} grows)")
    return summary


def params_digest(params) -> str:
  """A hex digest of the parameters' bytes (replicas compare equal bit for bit)."""
  return train_guard.digest(np.asarray(ravel_pytree(params)[0]))


def resume_point(config: TrainConfig, checkpoints, comm) -> tuple[int | None, int | None]:
  """(step, global batch) to resume from, as rank 0 reads them; (None, None): from scratch.

  Raises:
    ShrinkModeError: the directory holds checkpoints and `--resume` was not given.
  """
  if checkpoints is None:
    return None, None
  found = None
  if comm.rank == 0:
    latest = checkpoints.latest_step()
    found = (latest, None if latest is None else checkpoints.global_batch(latest))
  step, global_batch = comm.bcast_object(found)
  if step is not None and not config.resume:
    raise ShrinkModeError(f"{config.checkpoint_dir} already holds checkpoints (latest step "
                          f"{step}); pass --resume to continue that run, or choose an empty "
                          f"--checkpoint-dir.")
  if step is None and config.resume and comm.rank == 0:
    sys.stdout.write(f"jdist train --shrink: no checkpoint in {config.checkpoint_dir} yet: "
                     f"starting from scratch\n")
  return step, global_batch


def train(config: TrainConfig, on_step=None) -> dict:
  """Runs `config` in `--shrink` mode under `jdist launch --shrink`; returns the summary.

  Args:
    config: the run's settings (see `HONORED`).
    on_step: called as `on_step(step, launch_rank, replicas)` before every step (fault
      drills).

  Raises:
    ShrinkModeError: a setting this mode does not support.
  """
  check_config(config)
  os.environ.setdefault("JDIST_JAX_DISTRIBUTED", "0")
  growth = Growth.from_environment()
  # A wait past --timeout makes this process leave, as a lost one (StallGuard).
  shrinkable.STALLS.deadline_s = topology.resolve_timeout(config.timeout)
  joining = shrinkable.spawned()  # started by the survivors' start_growth(): handed the state
  data = program = None
  if joining:
    comm, data, program = _prepare_and_join(config)
  else:
    comm = shrinkable.ShrinkableComm()
  checkpoints = (shrink_checkpoints.ShrinkCheckpoints(config.checkpoint_dir,
                                                      config.checkpoint_every)
                 if config.checkpoint_dir else None)
  resume_step, global_batch = (None, comm.bcast_object(None)) if joining else (
      resume_point(config, checkpoints, comm))
  if comm.rank == 0 and not joining:  # for `jdist launch --max-restarts`: which host was lost
    abort.announce_hosts([comm.hosts[rank] for rank in sorted(comm.hosts)])
  try:
    run = ShrinkRun(config, data or train_lib.load_data(config), comm, on_step, growth,
                    global_batch=global_batch, checkpoints=checkpoints, program=program)
    if run.primary and not joining:
      sys.stdout.write(f"jdist train --shrink: {comm.size} processes, global batch "
                       f"{run.global_batch}, {run.total_steps} steps; lost processes are "
                       f"shrunk past (ULFM)"
                       f"{f', grown back to {growth.max_np}' if growth.max_np else ''}\n")
    return run.run(joined=run.share(None)[0] if joining else None, resume_step=resume_step)
  except TooFewProcesses as err:
    if comm.rank == 0:
      sys.stderr.write(f"jdist train --shrink: stopping: {err}.\n")
    shrinkable.leave(1)
  except BaseException:  # pylint: disable=broad-except
    # A rank that fails is a lost rank: it leaves now (MPI_Finalize would wait for
    # peers that wait for it) and the others shrink past it.
    traceback.print_exc()
    shrinkable.leave(1)


def warm_up(program: Program, config: TrainConfig, data: datasets.Dataset) -> None:
  """Compiles the step's functions at the shapes a run calls them with (`ShrinkRun`)."""
  params, state = program.init(config.seed)
  size, evaluated = config.batch_size, config.eval_batch
  gradient, _, _, _ = program.grads(params, state, data.train_x[:size], data.train_y[:size],
                                    np.ones(size, np.float32), float(size))
  flat, unravel = ravel_pytree(gradient)
  program.apply(params, program.opt_init(params), unravel(jnp.asarray(np.asarray(flat))))
  jax.block_until_ready(program.evaluate(params, state, data.test_x[:evaluated],
                                         data.test_y[:evaluated],
                                         np.ones(evaluated, np.float32)))


def _prepare_and_join(config: TrainConfig):
  """A started process: loads the data and compiles, then joins; leaves if sent away.

  Returns:
    (the job's communicator, the data, the compiled program).
  """
  try:
    data = train_lib.load_data(config)
    program = build_program(config, data.num_classes, data.train_x.shape[1:])
    warm_up(program, config, data)
    return shrinkable.ShrinkableComm.joined(), data, program
  except shrinkable.PeerLost as err:  # sent away, or a member failed: not a failure of its own
    sys.stderr.write(f"jdist train --shrink: a started process leaves: {err}.\n")
    shrinkable.leave(0)  # MPI_Finalize would wait for the members it is connected to
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  shrinkable.leave(1)


def leave(summary: dict, code: int = 0) -> None:
  """Ends this process once its run is done, if it lost processes.

  MPI_Finalize would wait for the lost ones; a run that lost none returns
  (and finalizes at exit, which mpirun wants: without it, a job under plain
  mpirun ends with status 1, "exiting improperly").
  """
  if summary.get("shrinks") or summary.get("grows"):
    shrinkable.leave(code)
