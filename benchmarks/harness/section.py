"""What a benchmark section is: `Section`, its `Run`s, and `UsageError`.

A section is something a user runs: `python -m benchmarks SECTION [--on
WHERE] [options]`. It declares itself: each module or package of
`benchmarks.sections` defines `SECTION = Section(...)`, and
`benchmarks.registry` finds them by iterating that package. WHERE is how it
reaches other processes:

  * `host`: on this machine; the command starts its own jobs (mpirun over
    shared memory) where it has any;
  * `mpirun`: every rank runs the command, so start it under mpirun
    (`bash scripts/mpirun.sh -np 2 python -m benchmarks SECTION`);
  * `shaped`: over `tc`-shaped links of a network namespace on one host
    (`benchmarks.harness.netns`; root);
  * `rig`: on the cluster rig, nodes of network namespaces with their own
    hostnames behind a shaped bridge (`benchmarks.harness.cluster`; root).

The same section on two kinds of link is one section with two runs: the
network benchmark runs on the shaped single-host links or on the rig.

A run is a module with `main(args) -> int` and, where it has options of its
own, `add_arguments(parser)` and `check(args)` (raises `UsageError`); only
`benchmarks.__main__` builds the parser. A run's `report` is the one function
that renders its Markdown report; `benchmarks.harness.outputs` writes every
report file.
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
    load: returns the module with `main(args)` (and optionally
      `add_arguments(parser)`, `check(args)`); a function, so a run whose
      module needs an extra is imported only when it runs.
    report: renders the Markdown report of this run from its results, or
      None when the run only prints.
    out: the default output directory, relative to the repository (None:
      no `--out DIR`; a section with a file to write declares its own).
    quick: whether it has a smoke run (`--quick`, output to a temporary
      directory unless `--out` is given).
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
