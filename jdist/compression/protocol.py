"""What a compression scheme is: a wire payload that reduces itself.

A scheme is one module of `jdist.compression` that owns three things: its
transformation (what a replica sends), its payload class (the registered
pytree node that carries it, with its decoding context as static aux data)
and how that payload is reduced over the replicas and decoded. The
collective layer knows no format: `jdist.allreduce` hands the payload an
`Exchange` and calls `payload.reduce_over_replicas(exchange, factor)`; a plain
pytree of arrays is the dense all-reduce.

Adding a scheme is one file here (a `WirePayload` subclass, the
transformation that emits it, and its `Scheme`: where `jdist.dist_opt` puts
it and which other schemes it combines with) and one keyword of
`jdist.dist_opt`.

Schemes whose reduction changes their own state (PowerSGD keeps the
error-feedback residual of what came back) cannot hand a payload on, since a
payload's reduction cannot write the compressor's state: such a scheme
replaces `jdist.allreduce` and runs its reduction itself through
`jdist.collectives.exchange`, with the same `Exchange`.

Transformations that exchange bytes across processes report them in a state
field `wire_bytes`; their state types are registered with
`register_wire_state`, and `jdist.wire_bytes(opt_state)` sums exactly those.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax



class Exchange(Protocol):
  """The reductions a payload may use, over every replica of the step.

  The collective layer builds it (`jdist.collectives.ops.ReplicaExchange`);
  everything crosses devices and processes through it.
  """

  @property
  def replicas(self) -> int:
    """How many values a reduction combines (the divisor of a mean)."""

  def sum(self, tree: Any) -> Any:
    """Sum of a pytree, full precision, fused into a few buffers."""

  def sum_16bit(self, tree: Any) -> Any:
    """Sum of a pytree whose 16-bit float leaves travel in 16 bits
    (accumulated in float32), the rest at full precision; fused."""

  def gather(self, buffer: jax.Array) -> jax.Array:
    """Every replica's 1-D buffer, stacked in global replica order: [R, n]."""

  @property
  def processes(self) -> int:
    """How many processes the reduction spans (rows of `gather_per_process`)."""

  def gather_per_process(self, buffer: jax.Array) -> jax.Array:
    """Every process's 1-D buffer, stacked in process order: [P, n].

    The buffer must be the same on every replica of a process (a value of
    `jdist.collectives.process_mean`'s): each crosses processes once, not
    once per local device.
    """


class WirePayload:
  """Base of the payloads a compressor hands to `jdist.allreduce`.

  Subclasses are registered pytree nodes (they pass through jit, pmap and
  `optax.chain` like a gradient tree) and implement `reduce_over_replicas`.

  Attributes:
    SCHEME: the scheme's name in the flight recorder's and the timeline's
      labels of its exchanges ("sparse": "allreduce / sparse: gather").
  """

  SCHEME = ""

  def reduce_over_replicas(self, exchange: Exchange, factor: float) -> Any:
    """Reduces this payload over every replica and decodes it.

    Args:
      exchange: the collective layer's reductions.
      factor: multiply the sum by this (1 / replicas for a mean, else 1).

    Returns:
      The reduced gradient tree, leaves in their original dtypes.
    """
    raise NotImplementedError

  def to_16bit(self, dtype: Any, scale: float) -> "WirePayload":
    """This payload with its values scaled by `scale` and cast to `dtype`.

    `jdist.cast` calls it when it follows another compressor.

    Raises:
      ValueError: the scheme's values cannot travel in 16 bits.
    """
    raise ValueError(f"jdist.cast cannot follow {type(self).__name__}: its values do not "
                     f"travel as 16-bit floats. Remove jdist.cast from the chain.")


STAGES = ("wrap", "select", "encode", "exchange", "after")


@dataclasses.dataclass(frozen=True)
class Scheme:
  """How `jdist.dist_opt` builds one communication scheme, and what it combines with.

  Declared once, next to the scheme's transformation; `jdist.dist_opt` and
  `jdist train`'s validation both read it.

  Attributes:
    keyword: its `jdist.dist_opt` keyword (and `jdist train` flag).
    stage: where it goes in `dist_opt`'s chain, `select, encode, allreduce
      (or exchange), inner, after`: "select" chooses what is sent (first),
      "encode" is the wire format (before `jdist.allreduce`), "exchange"
      replaces `jdist.allreduce`, "after" follows the inner optimizer, and
      "wrap" takes the inner optimizer and replaces the whole chain.
    parse: the keyword's setting -> None (off) or the value `build` takes;
      raises ValueError for a setting it does not understand.
    build: (value, options) -> the `optax.GradientTransformation`, where
      `options` holds `dist_opt`'s options by name. A "wrap" scheme's is
      called with `inner=` (the inner optimizer) and `chosen=` (the other
      chosen schemes' values) too.
    options: the `dist_opt` options it reads; another option set to a
      non-default value with no chosen scheme reading it is an error.
    combines_with: the keywords of the schemes it works with. Two schemes
      combine only when each names the other.
    does: what it does, in words, for error messages ("sends ...").
    flag: `jdist train`'s flag for it, as argparse's keyword arguments
      (`action`, `type`, `metavar`, `help`); the flag is `--KEYWORD` and
      the setting a field of `jdist.app.optimizer_spec.OptimizerSpec`,
      default off. None: the application declares its flag itself.
    mode: the chosen setting -> the scheme in the trainer's mode line
      ("qsgd 8-bit"); None: the keyword and the setting.
    local_momentum: the scheme compresses the momentum, not the gradient:
      `jdist train` moves an SGD momentum before it (the `momentum_correction`
      option, which the scheme then reads) without being asked.
  """
  keyword: str
  stage: str
  parse: Callable[[Any], Any]
  build: Callable[..., Any]
  options: tuple[str, ...] = ()
  combines_with: tuple[str, ...] = ()
  does: str = ""
  flag: dict[str, Any] | None = None
  mode: Callable[[Any], str] | None = None
  local_momentum: bool = False

  def describe(self, setting: Any) -> str:
    """The chosen `setting` in the trainer's mode line."""
    if self.mode is not None:
      return self.mode(setting)
    return self.keyword if setting is True else f"{self.keyword} {setting}"

  def __post_init__(self):
    if self.stage not in STAGES:
      raise ValueError(f"stage={self.stage!r} is not one of {STAGES}.")


def enabled(setting: Any) -> Any:
  """A setting that is on unless None or False, passed on as given (the scheme checks it)."""
  return None if setting is None or setting is False else setting


_WIRE_STATES: set[type] = set()


def register_wire_state(cls: type) -> type:
  """Marks a state type whose `wire_bytes` field counts bytes sent across processes.

  Usable as a class decorator; returns `cls`.

  Raises:
    ValueError: `cls` has no `wire_bytes` field.
  """
  if "wire_bytes" not in getattr(cls, "_fields", ()):
    raise ValueError(f"{cls.__name__} has no wire_bytes field to report.")
  _WIRE_STATES.add(cls)
  return cls


def is_wire_state(node: Any) -> bool:
  """True for an instance of a registered wire state type."""
  return type(node) in _WIRE_STATES


def wire_states(tree: Any) -> list[Any]:
  """The registered wire states in `tree` (e.g. an optimizer state), in leaf order."""
  return [node for node in jax.tree.leaves(tree, is_leaf=is_wire_state)
          if is_wire_state(node)]
