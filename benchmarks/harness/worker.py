"""One benchmark job's rank: `python -m benchmarks worker --out PREFIX --config JSON` runs the
config's measurements (`NAME`, `run(ctx)`) in order into `PREFIX.rank<R>.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
from typing import Any

import jax

import jdist
from benchmarks.harness import outputs


@dataclasses.dataclass
class Context:
  """What a section needs to know about the job it runs in."""
  job: str
  quick: bool
  topo: jdist.Topology
  options: dict[str, Any] = dataclasses.field(default_factory=dict)

  def sync(self) -> None:
    """All ranks meet here, so timed rounds start together."""
    jdist.barrier("benchmark sync")

  def repeats(self, full: int) -> int:
    """Timed rounds: `full`, or 3 in the smoke run."""
    return 3 if self.quick else full

  def warmup(self, full: int) -> int:
    """Untimed rounds first: `full`, or 1 in the smoke run."""
    return 1 if self.quick else full

  @property
  def rank(self) -> int:
    return self.topo.process_index


def init_backend(backend: str | None) -> tuple[jdist.Topology, str | None]:
  """`(jdist.init(backend=...), the error it raised or None)`: for "jax" a failed init is retried
  with `cluster_detection_method="mpi4py"` (what Open MPI 5 needs).
  """
  if backend != "jax":
    return jdist.init(backend=backend), None
  try:
    return jdist.init(backend="jax"), None
  except Exception as err:  # pylint: disable=broad-except
    error = f"{type(err).__name__}: {err}"
  original = jax.distributed.initialize
  jax.distributed.initialize = functools.partial(original, cluster_detection_method="mpi4py")
  try:
    return jdist.init(backend="jax"), error
  finally:
    jax.distributed.initialize = original


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--out", required=True, help="path prefix of the per-rank JSON files")
  parser.add_argument("--config", required=True, help="JSON: job, sections (measurement "
                      "modules), quick, backend")


def main(args: argparse.Namespace) -> int:
  config = json.loads(args.config)
  topo, init_error = init_backend(config.get("backend"))
  ctx = Context(job=config["job"], quick=bool(config.get("quick")), topo=topo,
                options=config.get("options", {}))
  recorder = outputs.Recorder(f"{args.out}.rank{ctx.rank}.json", {
      "job": ctx.job, "topology": str(topo), "rank": ctx.rank, "backend": topo.backend,
      "init_error": init_error})
  for qualified in config["sections"]:
    module = importlib.import_module(qualified)  # a measurement: `NAME` and `run(ctx)`
    recorder.record(module.NAME, lambda module=module: module.run(ctx))
  jdist.barrier("benchmark end")
  return 0
