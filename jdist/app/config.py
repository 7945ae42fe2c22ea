"""The training job's settings: one dataclass, checked before anything runs.

`TrainConfig` holds everything `jdist.app.train.train` needs; `jdist train` (see
`jdist.app.cli`) fills it from the command line. `validate` checks every value
and combination up front and raises `ConfigError` naming the setting (and
its command-line flag) and how to fix it, so a bad value never reaches JAX.
What a resumed run must keep is in `jdist.app.resume_policy`; the optimizer's
settings are built by `jdist.app.optimizer_spec`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jdist.app import datasets
from jdist.app.optimizer_spec import DILOCO_PAYLOADS
from jdist.app.optimizer_spec import HALF_CHOICES
from jdist.app.optimizer_spec import OPTIMIZERS
from jdist.app.optimizer_spec import OptimizerSpec
from jdist.compression.sparse import parse_sparsify
from jdist.transforms import diloco as diloco_lib

BACKENDS = ("auto", "mpi", "jax", "none")
ON_NONFINITE = ("stop", "rollback")


class ConfigError(ValueError):
  """A training setting is out of range or contradicts another one."""


def _with_optimizer_fields(cls):
  """Gives the settings class every `OptimizerSpec` field: same name, type and default."""
  for field in dataclasses.fields(OptimizerSpec):
    cls.__annotations__[field.name] = field.type
    setattr(cls, field.name, field.default)
  return cls


@dataclasses.dataclass
@_with_optimizer_fields
class TrainConfig:
  """Settings of one data-parallel training run.

  Attributes:
    model: a name in `jdist.app.models.MODELS` ("cnn", "mlp", "resnet20", ...).
    dataset: a name in `jdist.app.datasets.NAMES` ("digits" needs no files).
    data_dir: directory searched first for MNIST-format files.
    download: allow downloading MNIST-format datasets that are not found.
    epochs: passes over the training set (>= 1).
    batch_size: examples per replica per step; the global batch is
      batch_size x replica_count.
    eval_batch_size: examples per replica per evaluation step (0: the
      larger of batch_size and 128).
    (optimizer settings): every field of `OptimizerSpec` (optimizer, lr,
      momentum, half, sparsify, diloco, ...), with its default; the class
      takes them from there, and `optimizer_spec` is them as a spec.
    seed: seed of the initial parameters and of the data order (>= 0).
    train_limit, test_limit: use only the first N examples of each split.
    checkpoint_dir: where checkpoints go; None for none.
    checkpoint_every: also checkpoint every N steps (0: only at epoch ends).
    resume: continue from the latest checkpoint in checkpoint_dir.
    max_steps: stop (with a checkpoint) after this many steps in all; None
    local_checkpoint_every: also save to a fast per-node local tier every N
      steps (0: never); a resume takes the newest intact checkpoint of
      either tier (`jdist.app.checkpoint_tiers`); needs checkpoint_dir.
    local_checkpoint_dir: the local tier's directory (None: a per-node one
      under /dev/shm or the system temp dir).
      to run every epoch. Resuming afterwards continues the same run.
    log_file: JSON-lines log (one record per epoch and a summary), or None.
    eval_every: evaluate every N epochs (the last epoch always; 0: never).
    check_replicas_every: check every N steps, and at the end, that all
      replicas hold the same parameters, by an on-device checksum (0: never;
      under partial, after each full sync).
    on_nonfinite: what the trainer does when the state holds NaN or Inf
      (never saved): "stop" (an error, exit status 1) or "rollback" (restore
      the last checkpoint, go on past the batches since; needs
      checkpoint_dir).
    timeout: seconds a cross-process exchange may wait (None: jdist's
      default, $JDIST_TIMEOUT or 300).
    backend: "auto", "mpi", "jax" or "none" (see `jdist.init`).
    progress: show a progress bar on rank 0.
    cpu_devices: force this many host (CPU) devices per process, for testing
      data parallelism without accelerators; None leaves JAX's default.
    timeline: write a Chrome / Perfetto trace of every rank's steps and
      exchanges to this file (`jdist.timeline`, docs/timeline.md), or None.
    timeline_steps: "A:B": record train steps A to B-1 only (needs timeline).
  """

  model: str = "cnn"
  dataset: str = "digits"
  data_dir: str | None = None
  download: bool = True
  epochs: int = 3
  batch_size: int = 32
  eval_batch_size: int = 0
  seed: int = 0
  train_limit: int | None = None
  test_limit: int | None = None
  checkpoint_dir: str | None = None
  checkpoint_every: int = 0
  resume: bool = False
  max_steps: int | None = None
  local_checkpoint_every: int = 0
  local_checkpoint_dir: str | None = None
  log_file: str | None = None
  eval_every: int = 1
  check_replicas_every: int = 100
  on_nonfinite: str = "stop"
  timeout: float | None = None
  backend: str = "auto"
  progress: bool = True
  cpu_devices: int | None = None
  timeline: str | None = None
  timeline_steps: str | None = None

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @property
  def optimizer_spec(self) -> OptimizerSpec:
    """What builds this run's optimizer; also its compilation cache key."""
    return OptimizerSpec.from_settings(self)

  @property
  def local_updates(self) -> bool:
    """Whether replicas hold different parameters between syncs (partial, diloco, local SGD)."""
    return bool(self.partial or self.diloco or self.local_sgd)

  @property
  def eval_batch(self) -> int:
    return self.eval_batch_size or max(self.batch_size, 128)


def flag(name: str) -> str:
  """A setting's name with its command-line flag, for messages: `lr (--lr)`."""
  return f"{name} (--{name.replace('_', '-')})"


def _int(config: TrainConfig, name: str, minimum: int, optional: bool = False) -> None:
  value = getattr(config, name)
  if optional and value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ConfigError(f"{flag(name)}={value!r} must be an integer >= {minimum}.")


def _number(config: TrainConfig, name: str, low: float, high: float, *,
            low_open: bool, high_open: bool, hint: str) -> None:
  value = getattr(config, name)
  ok = (not isinstance(value, bool) and isinstance(value, (int, float))
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and (value < high if high_open else value <= high))
  if not ok:
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    raise ConfigError(f"{flag(name)}={value!r} must be a number in {interval}; {hint}.")


def validate(config: TrainConfig) -> TrainConfig:
  """Checks every setting and combination; returns the config for chaining.

  Raises:
    ConfigError: the first bad setting, named with its flag and the fix.
  """
  _check_names(config)
  _check_ranges(config)
  _check_communication(config)
  _check_checkpoints_and_recovery(config)
  return config


def _check_names(config: TrainConfig) -> None:
  """Raises ConfigError unless the model, dataset and optimizer are ones jdist train knows."""
  # Imported here: the models pull in Flax, which `jdist --help` need not load.
  from jdist.app import models  # pylint: disable=g-import-not-at-top

  if config.model not in models.MODELS:
    raise ConfigError(f"model (--model)={config.model!r} is unknown; choose one of "
                      f"{', '.join(sorted(models.MODELS))}.")
  if datasets.normalize_name(config.dataset) not in datasets.NAMES:
    raise ConfigError(f"dataset (--dataset)={config.dataset!r} is unknown; choose one of "
                      f"{', '.join(datasets.NAMES)}.")
  if config.optimizer not in OPTIMIZERS:
    raise ConfigError(f"optimizer (--optimizer)={config.optimizer!r} is unknown; choose "
                      f"one of {', '.join(OPTIMIZERS)}.")


def _check_ranges(config: TrainConfig) -> None:
  """Raises ConfigError for the first count or number out of range, or bad --timeline-steps."""
  _int(config, "epochs", 1)
  _int(config, "batch_size", 1)
  _int(config, "eval_batch_size", 0)
  _int(config, "seed", 0)
  _int(config, "train_limit", 1, optional=True)
  _int(config, "test_limit", 1, optional=True)
  _int(config, "checkpoint_every", 0)
  _int(config, "max_steps", 1, optional=True)
  _int(config, "local_checkpoint_every", 0)
  _int(config, "eval_every", 0)
  _int(config, "check_replicas_every", 0)
  _int(config, "cpu_devices", 1, optional=True)
  _check_timeline(config)
  _int(config, "partial", 1, optional=True)
  _int(config, "powersgd", 1, optional=True)
  _int(config, "diloco", 1, optional=True)
  _int(config, "diloco_fragments", 1)
  _int(config, "diloco_delay", 0)
  _int(config, "local_sgd", 1, optional=True)
  _int(config, "local_sgd_warmup", 0)
  _check_outer_step(config)
  _number(config, "diloco_mix", 0.0, 1.0, low_open=False, high_open=True,
          hint="the local share kept on an outer step, e.g. 0.5 (0: none)")
  _number(config, "lr", 0.0, math.inf, low_open=True, high_open=True,
          hint="the learning rate must be positive, e.g. 0.05")
  _number(config, "momentum", 0.0, 1.0, low_open=False, high_open=True,
          hint="use 0 for plain SGD, e.g. 0.9")
  _number(config, "weight_decay", 0.0, math.inf, low_open=False, high_open=True,
          hint="use 0 for none, e.g. 1e-4")
  if config.timeout is not None:
    _number(config, "timeout", 0.0, math.inf, low_open=True, high_open=True,
            hint="seconds a cross-process exchange may wait, e.g. 300")


def _check_communication(config: TrainConfig) -> None:
  """Raises ConfigError for a bad exchange setting: format, backend, mode or combination."""
  if config.half is not None and config.half not in HALF_CHOICES:
    raise ConfigError(f"half (--half)={config.half!r} is unknown; choose one of "
                      f"{', '.join(HALF_CHOICES)} (or leave it out for 32-bit gradients).")
  if config.sparsify is not None:
    try:
      parse_sparsify(config.sparsify)
    except ValueError as err:
      raise ConfigError(f"--{str(err)}") from None
  if config.backend not in BACKENDS:
    raise ConfigError(f"backend (--backend)={config.backend!r} is unknown; choose one of "
                      f"{', '.join(BACKENDS)}.")
  if config.momentum_correction and (config.optimizer != "sgd" or not config.momentum):
    raise ConfigError(
        "--momentum-correction moves SGD's momentum before the gradient compression: it needs "
        "--optimizer sgd and a --momentum above 0 (and a scheme that applies it, such as "
        "--sparsify).")
  _check_local_modes(config)
  try:  # which schemes combine: their own declarations, as jdist.dist_opt reads them
    config.optimizer_spec.check()
  except ValueError as err:
    raise ConfigError(str(err)) from None


def _check_checkpoints_and_recovery(config: TrainConfig) -> None:
  """Raises ConfigError for a bad --on-nonfinite, or a checkpoint setting lacking its needs."""
  if config.on_nonfinite not in ON_NONFINITE:
    raise ConfigError(f"on_nonfinite (--on-nonfinite)={config.on_nonfinite!r} is unknown; "
                      f"choose one of {', '.join(ON_NONFINITE)}.")
  if config.on_nonfinite == "rollback" and not config.checkpoint_dir:
    raise ConfigError("--on-nonfinite rollback needs --checkpoint-dir DIR: the checkpoints "
                      "to roll back to.")
  if config.resume and not config.checkpoint_dir:
    raise ConfigError("--resume needs --checkpoint-dir DIR: the directory to resume from.")
  if config.checkpoint_every and not config.checkpoint_dir:
    raise ConfigError("--checkpoint-every needs --checkpoint-dir DIR: where to write them.")
  if (config.local_checkpoint_every or config.local_checkpoint_dir) and not config.checkpoint_dir:
    raise ConfigError("--local-checkpoint-every needs --checkpoint-dir DIR: the persistent "
                      "tier the local one backs up.")
  if config.local_checkpoint_dir and not config.local_checkpoint_every:
    raise ConfigError("--local-checkpoint-dir needs --local-checkpoint-every STEPS.")


def _check_timeline(config: TrainConfig) -> None:
  from jdist.tracing import recorder as timeline_recorder  # pylint: disable=g-import-not-at-top
  if config.timeline_steps is not None and not config.timeline:
    raise ConfigError("timeline_steps (--timeline-steps) needs --timeline FILE.")
  try:
    timeline_recorder.parse_steps(config.timeline_steps)
  except ValueError as err:
    raise ConfigError(str(err)) from None


def _check_outer_step(config: TrainConfig) -> None:
  """--diloco-outer-lr and --diloco-outer-momentum, when given (None: the spec's rule)."""
  if config.diloco_outer_lr is not None:
    _number(config, "diloco_outer_lr", 0.0, math.inf, low_open=True, high_open=True,
            hint="DiLoCo's outer learning rate must be positive, e.g. 0.7 (leave it out "
            "for the default, fitted to --optimizer and --momentum)")
  if config.diloco_outer_momentum is not None:
    _number(config, "diloco_outer_momentum", 0.0, 1.0, low_open=False, high_open=True,
            hint="DiLoCo's outer Nesterov momentum, e.g. 0.9 (0: none; leave it out for "
            "the default, fitted to --optimizer and --momentum)")


def _check_local_modes(config: TrainConfig) -> None:
  """--diloco's and --local-sgd's own flags: only with them (their combinations: `check`)."""
  if config.diloco is not None:
    if config.diloco_fragments > config.diloco:
      raise ConfigError(f"{flag('diloco_fragments')}={config.diloco_fragments} must be <= "
                        f"--diloco {config.diloco}: each fragment syncs on a step of its own.")
    if config.diloco_delay >= config.diloco:
      raise ConfigError(f"{flag('diloco_delay')}={config.diloco_delay} must be < --diloco "
                        f"{config.diloco}: a fragment's outer step lands before its next "
                        f"exchange.")
  elif (config.diloco_fragments != OptimizerSpec.diloco_fragments
        or config.diloco_outer_lr is not None or config.diloco_outer_momentum is not None
        or config.diloco_backoff or config.diloco_payload is not None or config.diloco_delay
        or config.diloco_mix):
    raise ConfigError("--diloco-fragments, --diloco-outer-lr, --diloco-outer-momentum, "
                      "--diloco-backoff, --diloco-payload, --diloco-delay and --diloco-mix "
                      "only apply with --diloco H.")
  if config.diloco_payload is not None:
    try:
      if not isinstance(config.diloco_payload, str):
        raise ValueError("not a name")
      diloco_lib.payload_codec(config.diloco_payload)
    except ValueError as error:
      raise ConfigError(f"{flag('diloco_payload')}={config.diloco_payload!r} is not one of "
                        f"{', '.join(DILOCO_PAYLOADS)} or sparse:RATIO ({error}).") from None
    if config.half is not None:
      raise ConfigError(f"--half {config.half} and --diloco-payload {config.diloco_payload} "
                        f"both set DiLoCo's payload: keep --diloco-payload only.")
  if config.local_sgd is None and config.local_sgd_warmup:
    raise ConfigError("--local-sgd-warmup only applies with --local-sgd H.")
