"""What a benchmark section is: `Section`, its `Run`s (one per `--on` place), `UsageError`
(docs/benchmarks/index.md).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
from typing import Callable

HOST, MPIRUN, SHAPED, RIG = "host", "mpirun", "shaped", "rig"
PLACES = (HOST, MPIRUN, SHAPED, RIG)

# Optional extras (pyproject.toml) -> the module each installs. A section's modules
# import theirs at import time; every other module imports it only where it runs.
EXTRAS = {"torch-peer": "torch"}


def torch_missing() -> str | None:
  """Why the PyTorch peer cannot run here (its extra is missing), or None."""
  if importlib.util.find_spec("torch") is None:
    return ("torch is not installed: the DDP peer is skipped (pip install -e '.[torch-peer]' "
            "(torch==2.13.0, the CPU build))")
  return None


class UsageError(ValueError):
  """A section's options do not fit; the entry point reports it as a usage error."""


@dataclasses.dataclass(frozen=True)
class Run:
  """How a section runs in one place."""
  load: Callable[[], types.ModuleType]  # the run's module (late: a module needing an extra)
  report: Callable[[dict], str] | None = None  # its Markdown renderer (None: it only prints)
  out: str | None = None  # the default `--out`, relative to the repository (None: no `--out`)
  quick: bool = False  # whether it has a smoke run (`--quick`, into a temporary directory)

  @classmethod
  def of(cls, module: types.ModuleType, **kwargs) -> Run:
    """The run whose module is `module` (already imported)."""
    return cls(lambda: module, **kwargs)


@dataclasses.dataclass(frozen=True)
class Section:
  """A benchmark a user runs; `runs` maps each place it runs to how (the first: the default)."""
  name: str
  description: str
  runs: dict[str, Run]
  internal: bool = False  # a per-rank program the benchmarks launch themselves; not listed
  extra: str | None = None  # the optional extra (pyproject.toml) its modules import

  def run(self, place: str | None = None) -> Run:
    return self.runs[place or next(iter(self.runs))]

  def missing_extra(self) -> str | None:
    """Why this section's optional extra is not importable here, or None."""
    if self.extra is None or importlib.util.find_spec(EXTRAS[self.extra]) is not None:
      return None
    return (f"{EXTRAS[self.extra]} is not installed: section {self.name!r} needs the "
            f"{self.extra} extra (pip install -e '.[{self.extra}]')")


def section(name: str, description: str, *, internal: bool = False, extra: str | None = None,
            **runs: Run) -> Section:
  """`Section(name, description, runs)` with the runs as keywords (`shaped=Run(...)`)."""
  return Section(name, description, runs, internal, extra)
