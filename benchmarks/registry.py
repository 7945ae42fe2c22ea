"""Every benchmark section (each module or package of `benchmarks.sections` defines `SECTION`),
then the harness's per-rank programs (`PROGRAMS`); `python -m benchmarks list`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from benchmarks import sections as sections_pkg
from benchmarks.harness import section as section_lib
from benchmarks.harness.section import Run, Section, UsageError  # pylint: disable=unused-import

# The order of `list` (and of the docs' table); sections not named here follow by name.
ORDER = ("suite", "network", "time_to_accuracy", "lm_diloco", "accuracy", "diloco_overlap",
         "faults", "elastic_restart", "shrink", "styles", "jax_peers")


def _worker():
  from benchmarks.harness import worker  # pylint: disable=import-outside-toplevel
  return worker


def _torch_peer():
  from benchmarks.harness import torch_peer  # pylint: disable=import-outside-toplevel
  return torch_peer


PROGRAMS = (
    section_lib.section("worker", "one rank of a benchmark job (started by the jobs "
                        "themselves)", internal=True, mpirun=Run(_worker)),
    section_lib.section("torch_peer", "one rank of a PyTorch DDP job (started by the jobs "
                        "themselves)", internal=True, extra="torch-peer",
                        mpirun=Run(_torch_peer)),
)


@functools.cache
def all_sections() -> tuple[Section, ...]:
  """Every section (imported on the first call), then the internal programs."""
  found = []
  for info in pkgutil.iter_modules(sections_pkg.__path__):
    module = importlib.import_module(f"{sections_pkg.__name__}.{info.name}")
    if isinstance(getattr(module, "SECTION", None), Section):
      found.append(module.SECTION)
  rank = {name: index for index, name in enumerate(ORDER)}
  return tuple(sorted(found, key=lambda s: (rank.get(s.name, len(ORDER)), s.name))) + PROGRAMS


def names(internal: bool = False) -> tuple[str, ...]:
  return tuple(s.name for s in all_sections() if internal or not s.internal)


def section(name: str) -> Section:
  """The section called `name`; a `UsageError` naming the choices otherwise."""
  for candidate in PROGRAMS:  # a job's rank: no need to import every section
    if candidate.name == name:
      return candidate
  for candidate in all_sections():
    if candidate.name == name:
      return candidate
  raise UsageError(f"unknown section {name!r}; choose from {', '.join(names())} "
                   "(python -m benchmarks list)")


def table() -> str:
  """The `list` output: each section, where it runs and what it measures."""
  width = max(len(name) for name in names())
  return "\n".join(f"{s.name:<{width}}  {'|'.join(s.runs):<13}  {s.description}"
                   for s in all_sections() if not s.internal)
