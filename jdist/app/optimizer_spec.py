"""What builds a training run's optimizer: one frozen spec, the single source of truth.

`OptimizerSpec` holds every setting that changes the optax transformation
`jdist train` runs, and nothing else. Everything that depends on "which
optimizer is this" derives from it instead of listing settings again:

- `spec.build()` is the optimizer (`jdist.dist_opt` around an optax one);
- the spec itself is hashable, so it is the trainer's compilation cache key;
- `MUST_MATCH_ON_RESUME` / `MAY_DIFFER_ON_RESUME` come from each field's
  `resume` metadata (does the setting shape the optimizer state?);
- `spec.describe()` is the communication mode as the trainer prints it;
- `spec.check()` is `jdist.dist_opt`'s own check of which schemes combine
  (the schemes' declarations), with the errors naming flags.

A new optimizer setting is one new field here (with its `resume` metadata)
and its use in `build`; a new communication scheme declares its flag in its
`Scheme` and gets its field from there (`_with_scheme_fields`). `TrainConfig`
takes its optimizer fields from this class and the command line adds the flags, and `tests/test_optimizer_spec.py` fails for
any optimizer flag of `jdist train` that does not change the optimizer that
runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import optax

from jdist.transforms import dist_opt as dist_opt_lib
from jdist.transforms.diloco import PAYLOAD_CHOICES as DILOCO_PAYLOADS
from jdist.transforms.finite import skip_nonfinite

OPTIMIZERS = ("sgd", "adam", "adamw")
# DiLoCo's outer step (SGD, Nesterov momentum): the paper's, set for an inner
# AdamW, whose step is about its learning rate (its momentum is an average).
PAPER_OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
HALF_CHOICES = ("fp16", "bf16")

# A setting that shapes the optimizer state (its structure, or state that
# would mean something else) must match a checkpoint to resume from it.
_STATE = {"resume": "must_match"}
# A hyperparameter may change on resume; the run then differs from an
# uninterrupted one, which the trainer says.
_HYPER = {"resume": "may_differ"}


def _with_scheme_fields(cls):
  """Adds a field for each scheme that declares its `jdist train` flag (`Scheme.flag`).

  Off by default (False for a switch, else None); it shapes the optimizer
  state, so it must match on resume. A scheme with a flag is then one
  module and one `jdist.dist_opt` keyword: nothing here names it.
  """
  for scheme in reversed(dist_opt_lib.SCHEMES.values()):  # the plainest first: half, sparsify
    if scheme.flag is not None:
      switch = scheme.flag.get("action") == "store_true"
      cls.__annotations__[scheme.keyword] = "bool" if switch else "Any"
      setattr(cls, scheme.keyword, dataclasses.field(
          default=False if switch else None, metadata={**_STATE, "flag": scheme.flag}))
  return cls


@dataclasses.dataclass(frozen=True)
@_with_scheme_fields
class OptimizerSpec:
  """Every setting that decides which optimizer a training run builds.

  Attributes:
    optimizer: "sgd" (with momentum), "adam" or "adamw".
    lr: learning rate.
    momentum: SGD momentum, or Adam's b1.
    weight_decay: decoupled weight decay (adamw's, or added to sgd).
    momentum_correction: with sparsify (or signsgd) and sgd, the momentum
      is applied before the compression (Deep Gradient Compression).
    (schemes with a flag): one field per `jdist.dist_opt` scheme that
      declares its flag (`Scheme.flag`), off by default: half (None, "fp16"
      or "bf16"), sparsify ("topk:RATIO", "topk_block:RATIO",
      "threshold:VALUE"), partial (chunks), powersgd (a rank), qsgd, signsgd.
    skip_nonfinite: every replica skips steps whose gradients hold NaN/Inf.
    diloco: None or H: DiLoCo, H local inner steps between outer steps
      (`jdist.diloco`; with `half`, the pseudo-gradient travels in 16 bits).
    diloco_fragments: Streaming DiLoCo's fragments (1: plain DiLoCo).
    diloco_outer_lr: the outer optimizer's learning rate (SGD, Nesterov
      momentum); None: `outer_settings()`'s rule (the paper's 0.7, scaled
      to SGD's heavy-ball momentum past 0.9). Must match on resume.
    diloco_outer_momentum: the outer optimizer's Nesterov momentum; None:
      `outer_settings()`'s rule (the paper's 0.9 for adam/adamw, what SGD's
      heavy-ball momentum leaves of its gain: 0 at --momentum 0.9). Must
      match on resume (0 keeps no momentum state).
    diloco_payload: None (`half`'s, else float32), one of `DILOCO_PAYLOADS`
      or "sparse:RATIO": what the pseudo-gradient travels as ("int8",
      "int4" and "sparse" keep an error-feedback residual in the state).
    diloco_delay: τ, inner steps between a fragment's exchange and its outer
      step (`jdist.diloco`'s `delay`; the exchange runs in the background
      meanwhile on the native route, float32 or sparse payload); 0 <= τ < H. Must match
      on resume: it shapes the state (exchanges in flight).
    diloco_mix: on an outer step, the share of the local parameters kept
      (`jdist.diloco`'s `mix`, 0 <= mix < 1).
    diloco_backoff: when the training loss rises across outer syncs
      (`jdist.app.train_guard.DivergenceGuard`), halve the outer learning
      rate and go on. The outer learning rate then lives in the state
      (`optax.inject_hyperparams`), so it must match on resume.
    local_sgd: None or H: post-local SGD, parameters averaged every H local
      steps (`jdist.local_sgd`).
    local_sgd_warmup: fully synchronous steps before local SGD starts.
  """

  optimizer: str = dataclasses.field(default="sgd", metadata=_STATE)
  lr: float = dataclasses.field(default=0.05, metadata=_HYPER)
  momentum: float = dataclasses.field(default=0.9, metadata=_HYPER)
  weight_decay: float = dataclasses.field(default=0.0, metadata=_HYPER)
  momentum_correction: bool = dataclasses.field(default=False, metadata=_STATE)
  skip_nonfinite: bool = dataclasses.field(default=False, metadata=_STATE)
  diloco: int | None = dataclasses.field(default=None, metadata=_STATE)
  diloco_fragments: int = dataclasses.field(default=1, metadata=_STATE)
  diloco_outer_lr: float | None = dataclasses.field(default=None, metadata=_STATE)
  diloco_outer_momentum: float | None = dataclasses.field(default=None, metadata=_STATE)
  diloco_payload: str | None = dataclasses.field(default=None, metadata=_STATE)
  diloco_delay: int = dataclasses.field(default=0, metadata=_STATE)
  diloco_mix: float = dataclasses.field(default=0.0, metadata=_HYPER)
  diloco_backoff: bool = dataclasses.field(default=False, metadata=_STATE)
  local_sgd: int | None = dataclasses.field(default=None, metadata=_STATE)
  local_sgd_warmup: int = dataclasses.field(default=0, metadata=_STATE)

  @classmethod
  def from_settings(cls, settings: Any) -> "OptimizerSpec":
    """The spec of any object with attributes of the same names (a `TrainConfig`)."""
    return cls(**{name: getattr(settings, name) for name in FIELDS})

  def inner(self, correction: float = 0.0) -> optax.GradientTransformation:
    """The per-replica optax optimizer (sgd, adam or adamw) at these settings.

    Args:
      correction: a momentum that a compressor applies instead (momentum
        correction): the SGD here then has none.
    """
    if self.optimizer == "sgd":
      inner = optax.sgd(self.lr, momentum=None if correction else (self.momentum or None))
      if self.weight_decay:
        inner = optax.chain(optax.add_decayed_weights(self.weight_decay), inner)
      return inner
    if self.optimizer == "adam":
      return optax.adam(self.lr, b1=self.momentum)
    if self.optimizer == "adamw":
      return optax.adamw(self.lr, b1=self.momentum, weight_decay=self.weight_decay)
    raise ValueError(f"optimizer={self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}.")

  def build(self):
    """The data-parallel optax transformation this spec describes.

    Returns:
      `jdist.dist_opt` around the inner optimizer, wrapped in
      `jdist.skip_nonfinite` when asked.
    """
    # With momentum correction the momentum lives in the compressor instead.
    correction = self.momentum if self.momentum_correction or self._local_momentum() else 0.0
    inner = self.inner(correction)
    tx = dist_opt_lib.dist_opt(inner, **self._settings(), **self._options(correction))
    return skip_nonfinite(tx) if self.skip_nonfinite else tx

  def _local_momentum(self) -> bool:
    """An SGD momentum that a chosen scheme wants before it (`Scheme.local_momentum`)."""
    return self.optimizer == "sgd" and bool(self.momentum) and any(
        scheme.local_momentum and getattr(self, name) not in (None, False)
        for name, scheme in dist_opt_lib.SCHEMES.items())

  def _settings(self) -> dict[str, Any]:
    """The `jdist.dist_opt` scheme keywords this spec sets (the fields of the same names)."""
    settings = {name: getattr(self, name) for name in dist_opt_lib.SCHEMES}
    settings["half"] = {None: False, "fp16": jnp.float16, "bf16": jnp.bfloat16}.get(
        self.half, self.half)
    return settings

  def outer_settings(self) -> tuple[float, float, str]:
    """DiLoCo's outer (learning rate, Nesterov momentum), and where they come from.

    The paper's outer step (lr 0.7, Nesterov momentum 0.9) was set for an
    inner AdamW, whose step is about its learning rate (its momentum is an
    average): the outer momentum gives the run its momentum gain,
    1 / (1 - 0.9) = 10, and the product of the gains is 0.7 x 10 = 7.
    SGD's heavy-ball momentum β sums the gradients instead: its steps are
    already 1 / (1 - β) times the learning rate, and the paper's outer step
    on top of β = 0.9 makes the gain 70 (the main job then trains to
    chance). So with `--optimizer sgd` the outer momentum keeps only what
    the inner one leaves of the gain of 10: 1 / (1 - μ) = 10 (1 - β), μ = 0
    at β = 0.9; past β = 0.9 the outer lr shrinks by 10 (1 - β) as well.
    The product stays 7 for every β, and at β = 0 it is the paper's step.
    Without outer momentum there is no slow start either (a Nesterov
    momentum of 0.9 takes ~10 syncs to build up: too slow for a run with
    few syncs). Over the sparse payload the outer step has no momentum (its
    error feedback carries what momentum would), at SparseLoCo's lr 1 with
    adam/adamw: with Nesterov 0.9 the language model's sparse runs stalled
    (1.17 against plain's 0.16 at 1.05 M tokens), with SGD lr 1 they reach
    plain (docs/diloco.md). `--diloco-outer-lr` and `--diloco-outer-momentum`
    override.

    Returns:
      (lr, momentum, a note for the mode line).
    """
    lr, momentum, note = PAPER_OUTER_LR, OUTER_MOMENTUM, "the DiLoCo paper's"
    if self.optimizer == "sgd" and self.momentum:
      inner_gain = 1.0 / (1.0 - self.momentum)
      paper_gain = 1.0 / (1.0 - OUTER_MOMENTUM)
      momentum = round(max(0.0, 1.0 - inner_gain / paper_gain), 10)
      lr = round(PAPER_OUTER_LR * min(1.0, paper_gain / inner_gain), 10)
      note = (f"scaled to SGD's heavy-ball momentum {self.momentum:g}: outer x inner momentum "
              f"gain = the paper's {paper_gain:g}")
    if (self.diloco_payload or "").startswith("sparse") and momentum:
      # SparseLoCo's outer step: error feedback carries what the momentum would,
      # and a Nesterov 0.9 over 2% of the entries stalled the LM (docs/diloco.md).
      lr, momentum, note = (1.0 if self.optimizer != "sgd" else lr), 0.0, (
          "SparseLoCo's: no outer momentum over a sparse payload")
    given = [flag for flag, value in (("--diloco-outer-lr", self.diloco_outer_lr),
                                      ("--diloco-outer-momentum", self.diloco_outer_momentum))
             if value is not None]
    if given:
      note = " and ".join(given) + (f"; else {note}" if len(given) == 1 else "")
    lr = lr if self.diloco_outer_lr is None else self.diloco_outer_lr
    momentum = momentum if self.diloco_outer_momentum is None else self.diloco_outer_momentum
    return lr, momentum, note

  def outer(self) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum, at `outer_settings()`.

    With `diloco_backoff` its learning rate is a leaf of the state
    (`jdist.transforms.diloco.scale_outer_lr` halves it).
    """
    lr, momentum, _ = self.outer_settings()
    momentum = momentum or None  # 0: plain SGD, no momentum state
    if self.diloco_backoff:
      return optax.inject_hyperparams(optax.sgd, static_args=("momentum", "nesterov"))(
          learning_rate=lr, momentum=momentum, nesterov=True)
    return optax.sgd(lr, momentum=momentum, nesterov=True)

  def _options(self, correction: float = 0.0) -> dict[str, Any]:
    """The `jdist.dist_opt` options this spec sets."""
    outer = None
    if (self.diloco or self.diloco_outer_lr is not None or self.diloco_backoff
        or self.diloco_outer_momentum is not None):
      outer = self.outer()
    return {"momentum_correction": correction, "diloco_fragments": self.diloco_fragments,
            "diloco_outer": outer, "diloco_payload": self.diloco_payload,
            "diloco_delay": self.diloco_delay, "diloco_mix": self.diloco_mix,
            "local_sgd_warmup": self.local_sgd_warmup}

  def check(self, spell=lambda name: "--" + name.replace("_", "-")) -> None:
    """`jdist.dist_opt`'s check of these schemes and options, errors naming flags.

    Raises:
      ValueError: two schemes that do not combine, or an option no chosen
        scheme reads (`jdist.transforms.dist_opt.check_schemes`).
    """
    flags = {"diloco_outer": "--diloco-outer-lr/--diloco-outer-momentum"}
    options = self._options(self.momentum if self.momentum_correction or self._local_momentum()
                            else 0.0)
    dist_opt_lib.check_schemes(self._settings(), options,
                               spell=lambda name: flags.get(name, spell(name)))

  def _describe_scheme(self, name: str) -> str:
    """One chosen scheme with a flag in the mode line ("sparsify topk:0.01")."""
    scheme = dist_opt_lib.SCHEMES[name]
    words = scheme.describe(getattr(self, name))
    if scheme.local_momentum and self._local_momentum():
      return words + f" (SGD momentum {self.momentum:g} before it)"
    if self.momentum_correction and "momentum_correction" in scheme.options:
      return words + " with momentum correction"
    return words

  def describe(self) -> str:
    """The communication mode in words, e.g. "half bf16, sparsify topk:0.01"."""
    if self.diloco:
      fragments = (f", {self.diloco_fragments} fragments" if self.diloco_fragments > 1 else "")
      payload = self.diloco_payload or self.half
      payload = f", pseudo-gradient in {payload}" if payload else ""
      delay = (f", applied {self.diloco_delay} steps later" if self.diloco_delay else "")
      delay += f", mix {self.diloco_mix:g}" if self.diloco_mix else ""
      lr, momentum, note = self.outer_settings()
      backoff = ", halved if the loss rises across syncs" if self.diloco_backoff else ""
      return (f"diloco every {self.diloco} steps{fragments}, outer lr {lr:g}, Nesterov "
              f"momentum {momentum:g} ({note}){backoff}{payload}{delay}"
              + (", skip non-finite" if self.skip_nonfinite else ""))
    if self.local_sgd:
      warmup = (f" after {self.local_sgd_warmup} synchronous steps"
                if self.local_sgd_warmup else "")
      return (f"local SGD, parameters averaged every {self.local_sgd} steps{warmup}"
              + (", skip non-finite" if self.skip_nonfinite else ""))
    parts = [self._describe_scheme(name) for name, scheme in reversed(dist_opt_lib.SCHEMES.items())
             if scheme.flag is not None and getattr(self, name) not in (None, False)]
    parts += ["skip non-finite"] if self.skip_nonfinite else []
    return ", ".join(parts) or "plain all-reduce"


FIELDS = tuple(field.name for field in dataclasses.fields(OptimizerSpec))
MUST_MATCH_ON_RESUME = tuple(field.name for field in dataclasses.fields(OptimizerSpec)
                             if field.metadata["resume"] == "must_match")
MAY_DIFFER_ON_RESUME = tuple(field.name for field in dataclasses.fields(OptimizerSpec)
                             if field.metadata["resume"] == "may_differ")
