"""Every benchmark section, declared once; `python -m benchmarks` runs them.

A section is something a user runs: `python -m benchmarks SECTION [--on
WHERE] [options]` (`python -m benchmarks list` prints this table). WHERE is
how it reaches other processes:

  * `host`: on this machine; the command starts its own jobs (mpirun over
    shared memory) where it has any;
  * `mpirun`: every rank runs the command, so start it under mpirun
    (`bash scripts/mpirun.sh -np 2 python -m benchmarks SECTION`);
  * `shaped`: over `tc`-shaped links of a network namespace on one host
    (`benchmarks.netns`; root);
  * `rig`: on the cluster rig, nodes of network namespaces with their own
    hostnames behind a shaped bridge (`benchmarks.cluster`; root).

The same section on two kinds of link is one section with two runs: the
network benchmark runs on the shaped single-host links or on the rig.

Each run names a module of this package that provides `main(args) -> int`
and, where it has options of its own, `add_arguments(parser)` and
`check(args)` (raises `UsageError`); only `benchmarks.__main__` builds the
parser. A run's `report` names the one function that renders its Markdown
report; `benchmarks.outputs` writes every report file.

`MEASUREMENTS` are the parts a job's worker process (`benchmarks.worker`)
measures inside a section's jobs, and `SUITE_PARTS` the parts of the suite
(`python -m benchmarks suite --only ...`), both declared here too.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import types

HOST, MPIRUN, SHAPED, RIG = "host", "mpirun", "shaped", "rig"
PLACES = (HOST, MPIRUN, SHAPED, RIG)


class UsageError(ValueError):
  """A section's options do not fit; the entry point reports it as a usage error."""


@dataclasses.dataclass(frozen=True)
class Run:
  """How a section runs in one place.

  Attributes:
    module: the module of this package with `main(args)` (and optionally
      `add_arguments(parser)`, `check(args)`).
    report: "module.function" rendering the Markdown report of this run
      from its results, or None when the run only prints.
    out: the default output directory, relative to the repository (None:
      no `--out DIR`; a section with a file to write declares its own).
    quick: whether it has a smoke run (`--quick`, output to a temporary
      directory unless `--out` is given).
  """
  module: str
  report: str | None = None
  out: str | None = None
  quick: bool = False


@dataclasses.dataclass(frozen=True)
class Section:
  """A benchmark a user runs; `runs` maps each place it can run to how (the first is the default)."""
  name: str
  description: str
  runs: dict[str, Run]
  internal: bool = False  # a per-rank program the benchmarks launch themselves; not listed
  extra: str | None = None  # the optional extra (pyproject.toml) its modules import

  def run(self, place: str | None = None) -> Run:
    return self.runs[place or next(iter(self.runs))]


def _section(name: str, description: str, internal: bool = False, extra: str | None = None,
             **runs: Run) -> Section:
  return Section(name, description, runs, internal, extra)


# Optional extras (pyproject.toml) -> the module each installs. A section's modules
# import theirs at import time; every other module imports it only where it runs.
EXTRAS = {"torch-peer": "torch"}


SECTIONS: tuple[Section, ...] = (
    _section("suite", "the suite: all-reduce, fp16/bf16, overhead, compression, selection, "
             "scaling, backends, network (results.md and figures)",
             host=Run("suite", "report.markdown", "docs/benchmarks", quick=True)),
    _section("network", "jdist's modes against PyTorch DDP, whole training steps and "
             "all-reduce, over shaped links (network.md) or on the rig (cluster/results.md)",
             shaped=Run("network", "network_report.markdown", "docs/benchmarks", quick=True),
             rig=Run("cluster_bench", "cluster_report.markdown", "docs/benchmarks/cluster",
                     quick=True)),
    _section("time_to_accuracy", "seconds to a test accuracy, jdist's modes against "
             "PyTorch DDP over shaped links",
             shaped=Run("time_to_accuracy", "time_to_accuracy_report.markdown",
                        "docs/benchmarks/time_to_accuracy", quick=True)),
    _section("lm_diloco", "a small transformer language model: validation loss at equal "
             "tokens and time to a loss, DiLoCo against plain over shaped links",
             shaped=Run("lm_diloco", "lm_diloco_report.markdown",
                        "docs/benchmarks/lm_diloco", quick=True)),
    _section("accuracy", "test accuracy against compression, 2 processes",
             host=Run("accuracy", "accuracy.markdown", "docs/benchmarks")),
    _section("diloco_overlap", "Streaming DiLoCo's outer sync in the step or in the background",
             shaped=Run("diloco_overlap")),
    _section("faults", "lost nodes: time until a job is gone, and what it says",
             rig=Run("cluster_faults", "cluster_faults.markdown")),
    _section("elastic_restart", "a node lost mid-run under jdist launch --max-restarts",
             rig=Run("elastic_restart")),
    _section("elastic_chaos", "one jdist train under jdist launch through many faults",
             rig=Run("elastic_chaos")),
    _section("styles", "a jit step over global arrays against data_parallel",
             mpirun=Run("styles")),
    _section("worker", "one rank of a benchmark job (started by the jobs themselves)",
             internal=True, mpirun=Run("worker")),
    _section("torch_peer", "one rank of a PyTorch DDP job (started by the jobs themselves)",
             internal=True, extra="torch-peer", mpirun=Run("torch_peer")),
)

# The suite's parts (`suite --only`); "backends" is the backend-"jax" job's all-reduce and
# "network" the network section on shaped links.
SUITE_PARTS = ("allreduce", "half", "overhead", "compression", "selection", "scaling",
               "backends", "network")

# Measurement name -> module whose `run(ctx)` a job's worker runs (jobs name these).
MEASUREMENTS = {
    "allreduce": "allreduce",
    "cluster_allreduce": "cluster_allreduce",
    "overhead": "overhead",
    "compression": "compression",
    "selection": "selection",
    "scaling": "scaling",
    "half": "half",
    "accuracy": "accuracy",
    "network": "network_steps",
    "diloco_overlap": "diloco_overlap",
    "time_to_accuracy": "train_to_target",
    "lm_diloco": "lm_train",
}


def names(internal: bool = False) -> tuple[str, ...]:
  return tuple(s.name for s in SECTIONS if internal or not s.internal)


def section(name: str) -> Section:
  """The section called `name`; a `UsageError` naming the choices otherwise."""
  for candidate in SECTIONS:
    if candidate.name == name:
      return candidate
  raise UsageError(f"unknown section {name!r}; choose from {', '.join(names())} "
                   "(python -m benchmarks list)")


def missing_extra(section: Section) -> str | None:
  """Why `section`'s optional extra is not importable here, or None (none needed, or installed)."""
  if section.extra is None or importlib.util.find_spec(EXTRAS[section.extra]) is not None:
    return None
  return (f"{EXTRAS[section.extra]} is not installed: section {section.name!r} needs the "
          f"{section.extra} extra (pip install -e '.[{section.extra}]')")


def module(run: Run) -> types.ModuleType:
  return importlib.import_module(f"benchmarks.{run.module}")


def renderer(run: Run):
  """The function that renders `run`'s Markdown report (None when it only prints)."""
  if run.report is None:
    return None
  module_name, _, function = run.report.rpartition(".")
  return getattr(importlib.import_module(f"benchmarks.{module_name}"), function)


def table() -> str:
  """The `list` output: each section, where it runs and what it measures."""
  width = max(len(name) for name in names())
  return "\n".join(f"{s.name:<{width}}  {'|'.join(s.runs):<13}  {s.description}"
                   for s in SECTIONS if not s.internal)
