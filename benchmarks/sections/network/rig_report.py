"""The rig's analysis (ratios, issue 25's targets) and its results.md.

All-reduce: Open MPI, the hand-written hierarchical one and `jdist.psum` against the link
floor (the buffer once over the node's link); training: `report.summarize`'s exposed
exchange, as in network.md.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import analysis
from benchmarks.harness import netns
from benchmarks.harness import report
from benchmarks.sections.network import report as network_report

num, ms, size, table = report.num, report.ms, report.size, report.table
ALLREDUCE_TARGET = ("all-reduce 16 MB: jdist / Open MPI MPI_Allreduce", "1gbit", 16 << 20, 0.6)
TRAIN_TARGETS = (("exposed exchange: jdist plain / DDP", "plain", 0.7),
                 ("exposed exchange: jdist fp16 / DDP fp16 hook", "fp16", 0.7))
# The same ratios net of waiting for the slowest process's compute (each side's).
SLOWEST_NOTE = ", beyond the slowest rank's compute"
TRAIN_SECTIONS = ("network", "torch")
_target = analysis._target  # pylint: disable=protected-access


def allreduce(jobs: list[dict]) -> list[dict]:
  """One row per link and size: each variant's median and the ratios between them."""
  times: dict[tuple[str, int], dict[str, Any]] = {}
  for job in jobs:
    for row in analysis.section_rows([job], "cluster_allreduce"):
      cell = times.setdefault((job["link"], row["bytes"]), {"route": None})
      cell[row["variant"]] = row["time_s"]
      if row["variant"].startswith("jdist"):
        cell["route"] = row["route"]
        cell["node_aware"] = row.get("node_aware", False)
  out = []
  for (link, nbytes), cell in times.items():
    rate = netns.link_named(link).rate_mbit
    mpi, hier, mine = cell.get("mpi"), cell.get("hierarchical"), cell.get("jdist_psum")
    flat = cell.get("jdist_flat")
    ratio = lambda a, b: None if a is None or not b else a / b
    out.append({"link": link, "bytes": nbytes, "route": cell["route"],
                "node_aware": cell.get("node_aware", False), "jdist_flat_s": flat,
                "flat_vs_mpi": ratio(flat, mpi), "jdist_vs_flat": ratio(mine, flat),
                "floor_s": None if rate is None else nbytes * 8 / (rate * 1e6),
                "mpi_s": mpi, "hierarchical_s": hier, "jdist_s": mine,
                "jdist_vs_mpi": ratio(mine, mpi), "hierarchical_vs_mpi": ratio(hier, mpi),
                "jdist_vs_hierarchical": ratio(mine, hier)})
  return out


def training(jobs: list[dict]) -> list[dict]:
  """`network_report.summarize`'s rows for the jdist and DDP training sections."""
  picked = [dict(job, sections={k: v for k, v in job.get("sections", {}).items()
                                if k in TRAIN_SECTIONS}) for job in jobs]
  return network_report.summarize({"jobs": picked})["rows"]


def targets(summary: dict) -> list[dict]:
  """Issue 25's targets on the rig, each with its measured ratio."""
  name, link, nbytes, bound = ALLREDUCE_TARGET
  out = []
  for row in summary["allreduce"]:
    if (row["link"], row["bytes"]) == (link, nbytes):
      out.append(_target(name, row["jdist_vs_mpi"], bound, f"{link}, 2 nodes x 2"))
  for name, variant, bound in TRAIN_TARGETS:
    for row in summary["training"]:
      if row["variant"] == variant and row["link"] == "1gbit":
        out.append(_target(name, row["comm_vs_reference"], bound, "1gbit, 2 nodes x 2"))
        if row.get("comm_slowest_vs_reference") is not None:
          out.append(_target(name + SLOWEST_NOTE, row["comm_slowest_vs_reference"], bound,
                             "1gbit, 2 nodes x 2"))
  return out


def summarize(results: dict) -> dict[str, Any]:
  jobs = results["jobs"]
  summary = {"allreduce": allreduce(jobs), "training": training(jobs),
             "failures": analysis.failures(jobs)}
  summary["targets"] = targets(summary)
  return summary


def _allreduce_tables(rows: list[dict]) -> list[str]:
  lines = []
  for link in network_report.link_order(rows):
    mine = sorted((r for r in rows if r["link"] == link), key=lambda r: r["bytes"])
    with_flat = any(r["jdist_flat_s"] is not None for r in mine)
    how = f"{mine[0]['route']} route{', node-aware' if mine[0]['node_aware'] else ''}"
    lines += [f"### {link} per node", ""]
    lines += table(["size", "link floor ms", "Open MPI ms", "hierarchical ms", f"jdist ms ({how})"]
                   + (["jdist flat ms"] if with_flat else [])
                   + ["jdist / Open MPI", "hierarchical / Open MPI", "jdist / hierarchical"]
                   + (["jdist flat / Open MPI", "jdist / jdist flat"] if with_flat else []),
                   [[size(r["bytes"]), ms(r["floor_s"]), ms(r["mpi_s"]), ms(r["hierarchical_s"]),
                     ms(r["jdist_s"])] + ([ms(r["jdist_flat_s"])] if with_flat else [])
                    + [num(r["jdist_vs_mpi"]), num(r["hierarchical_vs_mpi"]),
                       num(r["jdist_vs_hierarchical"])]
                    + ([num(r["flat_vs_mpi"]), num(r["jdist_vs_flat"])] if with_flat else [])
                    for r in mine])
  return lines


def _training_table(rows: list[dict]) -> list[str]:
  order = {"torch_compute": 1, "ddp": 2, "ddp_fp16": 3, "compute": 4, "plain": 5, "fp16": 6}
  body = []
  for link in network_report.link_order(rows):
    mine = sorted((r for r in rows if r["link"] == link), key=lambda r: order.get(r["variant"], 9))
    for r in mine:
      side = "PyTorch DDP (gloo, torchrun)" if r.get("kind") == "torch" else "jdist (mpirun)"
      bare = r["variant"] in ("compute", "torch_compute")
      exposed = "-" if bare else ms(r["comm_s"])
      beyond = "-" if bare or r.get("comm_slowest_s") is None else ms(r["comm_slowest_s"])
      jdist_row = r.get("kind") == "jdist"
      body.append([link, side, r["variant"], ms(r["step_s"]), ms(r["compute_s"]), exposed,
                   beyond, num(r.get("comm_vs_reference")) if jdist_row else "-",
                   num(r.get("comm_slowest_vs_reference")) if jdist_row else "-",
                   num(r.get("step_vs_reference")) if jdist_row else "-"])
  return table(["link", "side", "variant", "step ms", "own compute-only ms", "exposed exchange ms",
                "beyond slowest compute ms", "exposed / DDP's", "beyond slowest / DDP's",
                "step / DDP's"], body)


def markdown(results: dict) -> str:
  """results.md: method, versions, targets, all-reduce and training tables."""
  summary = results["summary"]
  lines = report.header(
      "jdist and its peers on the cluster rig", results,
      "Every rank of both nodes runs on these cores: the rig emulates the network between "
      "nodes, not their CPUs.",
      f"Rig (`benchmarks/harness/cluster.py`): {results['topology']} device, each node a network "
      "namespace with its own hostname and a veth into a bridge, shaped by `tc tbf` on both "
      "ends (the rate per node and direction, shared by the node's 2 ranks). Open MPI: "
      "`mpirun --hostfile` through the rig's launch agent, `ob1` with `sm` inside a node and "
      "`tcp` between nodes, `mpi_yield_when_idle=1` (every rank of both nodes shares 2 cores: "
      "a busy-polling rank starves the one it waits for). PyTorch: one `torchrun --nnodes 2 "
      "--nproc-per-node 2` per node in its namespace, gloo over `eth0`, `OMP_NUM_THREADS=1`.",
      "All-reduce: float32, the variants interleaved round by round in one `mpirun` job, "
      "medians (3 to 15 rounds, from a warm-up round: about 3 s per variant and size). "
      "`Open MPI` is mpi4py `Allreduce` between numpy buffers with Open MPI's own algorithm "
      "choice; `hierarchical` is written by hand in mpi4py (reduce-scatter in the node over shared "
      "memory, all-reduce across nodes among ranks of the same local rank, all-gather in the "
      "node); `jdist` is `jdist.psum` in a jitted `jdist.data_parallel` step (node-aware where "
      "the engine chose it; `jdist flat`: the same with the engine's sums switched to flat "
      "for each call). Link floor: "
      "the buffer once over the node's link, the least an all-reduce between two nodes moves.",
      "Training: SINGA's CNN (431,080 parameters), 64 synthetic 28x28x1 images per rank, "
      "SGD; each side's variants interleaved round by round with its own compute-only step "
      "(jdist: `compute`, torch: `torch_compute`); exposed exchange = median over rounds of "
      "step - compute-only (this rank's, in the same round); `beyond slowest compute`: step - "
      "the slowest rank's compute-only step of the round (gathered after the timed rounds), "
      "as a synchronized step first waits for the slowest backward pass: with 4 ranks on 2 "
      "cores that wait is the machine's load, not the link. The jdist job and the DDP job run one after the other on the same "
      "rig, not interleaved with each other.")
  lines += ["## Targets (issue 25)", ""] + table(
      ["target", "where", "bound", "measured", ""],
      [[t["target"], t["where"], f"<= {t['bound']}", num(t["measured"]), report.STATUS[t["met"]]]
       for t in summary["targets"]])
  if summary["allreduce"]:
    lines += ["## All-reduce across 2 nodes x 2 processes", ""]
    lines += _allreduce_tables(summary["allreduce"])
  if summary["training"]:
    lines += ["## Training step: jdist beside PyTorch DDP", ""]
    lines += _training_table(summary["training"])
  lines += report.failures([(f"job {f['job']}", f["error"]) for f in summary["failures"]])
  return "\n".join(lines) + "\n"
