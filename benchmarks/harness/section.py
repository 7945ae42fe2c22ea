"""What a benchmark section is: `Section`, its `Run`s, and `UsageError`.

A section runs in one or more places (`--on`): `host` (this machine; jobs over shared
memory), `mpirun` (every rank runs the command), `shaped` (`tc`-shaped links of a network
namespace, `netns`; root) or `rig` (nodes of network namespaces, `cluster`; root). A run
is a module with `main(args) -> int` and optionally `add_arguments(parser)` and
`check(args)`; its `report` renders its Markdown, which `outputs` writes.
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


class UsageError(ValueError):
  """A section's options do not fit; the entry point reports it as a usage error."""


@dataclasses.dataclass(frozen=True)
class Run:
  """How a section runs in one place.

  Attributes:
    load: returns the run's module (a function: a module needing an extra loads late).
    report: renders the run's Markdown report from its results (None: it only prints).
    out: the default `--out` directory, relative to the repository (None: no `--out`).
    quick: whether it has a smoke run (`--quick`, into a temporary directory).
  """
  load: Callable[[], types.ModuleType]
  report: Callable[[dict], str] | None = None
  out: str | None = None
  quick: bool = False

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
