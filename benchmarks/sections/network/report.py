"""The network section's analysis and reports: network.md (shaped links) and, `rig_*`, the rig's
results.md (method: docs/benchmarks/network.md).
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import analysis
from benchmarks.harness import netns
from benchmarks.harness import report

num, ms, size, table = report.num, report.ms, report.size, report.table
# The targets: (name, variant, reference variant, measure "comm"/"step", {link: bound}).
TARGETS = (
    ("exposed comm jdist plain / DDP plain", "plain", "ddp", "comm",
     {"1gbit": 0.5, "100mbit": 0.95}),
    ("exposed comm jdist fp16 / DDP+fp16 hook", "fp16", "ddp_fp16", "comm",
     {"1gbit": 0.5, "100mbit": 0.95}),
    ("step jdist plain / DDP plain", "plain", "ddp", "step", {"1gbit": 0.95, "100mbit": 0.95}),
    ("step jdist fp16 / DDP+fp16 hook", "fp16", "ddp_fp16", "step",
     {"1gbit": 0.95, "100mbit": 0.95}),
    ("comm jdist fp16 / jdist plain", "fp16", "plain", "comm", {"1gbit": 0.55}),
    ("comm jdist top-K 1% / jdist plain", "topk1%", "plain", "comm", {"1gbit": 0.15}),
    ("comm jdist top-K 1% block / jdist plain", "topk1%-block", "plain", "comm",
     {"1gbit": 0.15}),
)
HALF_MODES = ("fp16", "bf16")


def _rows(results: dict) -> list[dict]:
  """Every job's timed rows (results of older runs may hold timeline rows: left out)."""
  return [dict(row, link=job["link"], topology=job["topology_name"])
          for job in results["jobs"] for section in job.get("sections", {}).values()
          for row in section.get("rows", []) if row.get("kind") != "timeline"]


def _ratio(a: float | None, b: float | None) -> float | None:
  """a / b for times; a time below zero (hidden, within noise) counts as zero."""
  if a is None or b is None:
    return None
  a = max(a, 0.0)
  if b <= 0:
    return None if a == 0 else float("inf")
  return a / b


def summarize(results: dict) -> dict[str, Any]:
  """Per-variant step and comm times, ratios against DDP and plain, targets."""
  rows = _rows(results)
  by_key = {(r["link"], r["topology"], r["variant"]): r for r in rows}  # raw, then derived
  out = []
  for row in rows:
    own = "torch_compute" if row.get("kind") == "torch" else "compute"
    own_compute = by_key.get((row["link"], row["topology"], own), {}).get("time_s")
    of_medians = None if own_compute is None else row["time_s"] - own_compute
    if row.get("kind") == "floor":
      comm = row["time_s"]
    else:  # per-round differences cancel load drift; medians' difference if absent
      comm = row.get("comm_paired_s", of_medians)
    out.append(dict(row, step_s=row["time_s"], compute_s=own_compute, comm_s=comm,
                    comm_of_medians_s=of_medians,
                    comm_slowest_s=comm if row.get("kind") == "floor"
                    else row.get("comm_vs_slowest_s")))
  by_key = {(r["link"], r["topology"], r["variant"]): r for r in out}
  for row in out:
    cell = (row["link"], row["topology"])
    ddp, ddp_half = by_key.get(cell + ("ddp",)), by_key.get(cell + ("ddp_fp16",))
    plain = by_key.get(cell + ("plain",))
    reference = ddp_half if row["variant"] in HALF_MODES else ddp
    row.update(
        step_vs_ddp=_ratio(row["step_s"], ddp and ddp["step_s"]),
        comm_vs_ddp=_ratio(row["comm_s"], ddp and ddp["comm_s"]),
        step_vs_ddp_fp16=_ratio(row["step_s"], ddp_half and ddp_half["step_s"]),
        comm_vs_ddp_fp16=_ratio(row["comm_s"], ddp_half and ddp_half["comm_s"]),
        comm_vs_plain=_ratio(row["comm_s"], plain and plain["comm_s"]),
        reference=reference and reference["variant"],
        step_vs_reference=_ratio(row["step_s"], reference and reference["step_s"]),
        comm_vs_reference=_ratio(row["comm_s"], reference and reference["comm_s"]),
        comm_slowest_vs_reference=_ratio(row["comm_slowest_s"],
                                         reference and reference["comm_slowest_s"]))
  summary = {"rows": out, "failures": analysis.failures(results["jobs"])}
  summary["targets"] = targets(by_key)
  summary["best"] = best_modes(out)
  return summary


def targets(by_key: dict) -> list[dict]:
  """Each target of the issue in every topology measured, with its ratio."""
  out = []
  topologies = sorted({key[1] for key in by_key})
  for name, variant, reference, measure, bounds in TARGETS:
    for link, bound in bounds.items():
      for topology in topologies:
        mine, theirs = by_key.get((link, topology, variant)), by_key.get(
            (link, topology, reference))
        if mine is None:
          continue
        value = _ratio(mine and mine[f"{measure}_s"], theirs and theirs[f"{measure}_s"])
        target = analysis.target(name, value, bound, f"{topology} {link}")
        if measure == "step":  # the median of per-round ratios, beside the ratio of medians
          target["paired"] = mine.get(f"paired_vs_{reference}")
        out.append(target)
  return out


def best_modes(rows: list[dict]) -> list[dict]:
  """The fastest jdist mode (median step) per topology and link."""
  cells = sorted({(r["topology"], r["link"]) for r in rows})
  out = []
  for topology, link in cells:
    mine = [r for r in rows if (r["topology"], r["link"]) == (topology, link)
            and r.get("kind") == "jdist"]
    dense = [r for r in mine if r["variant"] in ("plain",) + HALF_MODES]
    if not mine:
      continue
    fastest = min(mine, key=lambda r: r["step_s"])
    fastest_dense = min(dense, key=lambda r: r["step_s"]) if dense else None
    plain = next((r for r in mine if r["variant"] == "plain"), None)
    out.append({"topology": topology, "link": link, "fastest": fastest["variant"],
                "fastest_step_s": fastest["step_s"],
                "fastest_dense": fastest_dense and fastest_dense["variant"],
                "fastest_dense_step_s": fastest_dense and fastest_dense["step_s"],
                "plain_step_s": plain and plain["step_s"]})
  return out


def by_variant(summary: dict, row: dict, variant: str) -> float | None:
  """The median step of `variant` in `row`'s cell."""
  return next((o["step_s"] for o in summary["rows"] if (o["link"], o["topology"], o["variant"])
               == (row["link"], row["topology"], variant)), None)


def link_order(rows: list[dict]) -> list[str]:
  """The links of `rows`, fastest first (as `netns.LINKS` orders them)."""
  present = {r["link"] for r in rows}
  return [link.name for link in netns.LINKS if link.name in present]


def _by_variant_and_link(summary: dict, topology: str, cell, header: str,
                         kinds: tuple[str, ...] | None = None) -> list[str]:
  """A table of `cell(row)` with one line per variant and one column per link."""
  links = link_order(summary["rows"])
  mine = [r for r in summary["rows"] if r["topology"] == topology
          and (kinds is None or r.get("kind") in kinds)]
  index = {(r["variant"], r["link"]): r for r in mine}
  body = [[variant] + ["-" if index.get((variant, link)) is None
                       else cell(index[(variant, link)]) for link in links]
          for variant in dict.fromkeys(r["variant"] for r in mine)]
  return report.table(["variant"] + [f"{link}: {header}" for link in links], body)


def _grid(summary: dict, topology: str) -> list[str]:
  return _by_variant_and_link(
      summary, topology, lambda r: f"{report.ms(r['step_s'])} / {report.ms(r['comm_s'])}",
      "step / comm ms")


def _ratios(summary: dict, topology: str) -> list[str]:
  return _by_variant_and_link(
      summary, topology,
      lambda r: (f"{report.num(r['step_vs_reference'])} / "
                 f"{report.num(r['comm_vs_reference'])} / {report.num(r['comm_vs_plain'])}"),
      "step/DDP, comm/DDP, comm/plain", kinds=("jdist", "handwritten"))


def markdown(results: dict) -> str:
  """network.md: method, skipped parts, targets, tables, best modes, figure."""
  summary = results["summary"]
  lines = report.header(
      "jdist on an emulated cluster network", results,
      "Links: `shm` is Open MPI's default transport on one box (no namespace); the "
      "others run every rank in one private network namespace whose loopback is shaped "
      "by `tc` (`tbf`; delay: `netem`), Open MPI over TCP (`--mca pml ob1 --mca btl "
      "tcp,self --mca btl_tcp_if_include lo`), gloo with `GLOO_SOCKET_IFNAME=lo`. Both "
      "ranks share the one link.",
      "Workload: SINGA's CNN (431,080 parameters), 64 synthetic 28x28x1 images per "
      "replica, SGD. 2x2: 2 processes x 2 forced host devices for jdist; the torch peer "
      "trains 128 images per process (a node's two replicas summed locally).",
      "Each job's variants run interleaved round by round; medians. comm = the median "
      "over rounds of step - the same side's compute-only step in that round (jdist: "
      "`compute`, no exchange; torch: `torch_compute`, no DDP). jdist and torch run in "
      "the same processes, interleaved round by round.")
  body = [[t["target"], t["where"], f"<= {t['bound']}", report.num(t["measured"]),
           report.num(t.get("paired")), report.STATUS[t["met"]]]
          for t in summary["targets"]]
  lines += ["## Targets", "",
            "comm: ratios of the per-round comm medians (see the method above); step: the "
            "ratio of medians and the median of per-round ratios (`paired`: each round runs "
            "both steps back to back, so load drift cancels).", ""
            ] + report.table(["target", "where", "bound", "measured", "paired", ""], body)
  compute = [r for r in summary["rows"] if r["variant"] == "compute"
             and r.get("paired_vs_torch_compute")]
  if compute:
    body = [[r["topology"], r["link"], report.ms(r["step_s"]),
             report.ms(by_variant(summary, r, "torch_compute")),
             report.num(r["paired_vs_torch_compute"])] for r in compute]
    lines += ["## Compute only: XLA:CPU against PyTorch", "",
              "The same model, batch and SGD step without any exchange (jdist: XLA's "
              "default CPU thread pool per process; torch: its `threads` per process).", ""
              ] + report.table(["topology", "link", "jdist compute ms", "torch compute ms",
                                "jdist/torch (paired)"], body)
  for topology in sorted({r["topology"] for r in summary["rows"]}):
    lines += [f"## {topology}: median step / communication ms", ""] + _grid(summary, topology)
    lines += [f"### {topology}: ratios against DDP (fp16 and bf16 against DDP + fp16 hook) "
              "and jdist plain", ""] + _ratios(summary, topology)
  body = [[b["topology"], b["link"], b["fastest"], report.ms(b["fastest_step_s"]),
           b["fastest_dense"] or "-", report.ms(b["fastest_dense_step_s"]),
           report.ms(b["plain_step_s"])] for b in summary["best"]]
  lines += ["## Fastest jdist mode per link (median step)", ""] + report.table(
      ["topology", "link", "fastest", "ms", "fastest dense (plain/fp16/bf16)", "ms",
       "plain ms"], body)
  lines += report.failures([(f"job {f['job']}", f["error"]) for f in summary["failures"]])
  lines += [f"![{name}]({name}.png)" for name in results.get("figures", [])]
  return "\n".join(lines) + "\n"


ALLREDUCE_TARGET = ("all-reduce 16 MB: jdist / Open MPI MPI_Allreduce", "1gbit", 16 << 20, 0.6)
TRAIN_TARGETS = (("exposed exchange: jdist plain / DDP", "plain", 0.7),
                 ("exposed exchange: jdist fp16 / DDP fp16 hook", "fp16", 0.7))
# The same ratios net of waiting for the slowest process's compute (each side's).
SLOWEST_NOTE = ", beyond the slowest rank's compute"
TRAIN_SECTIONS = ("network", "torch")


def rig_allreduce(jobs: list[dict]) -> list[dict]:
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


def rig_training(jobs: list[dict]) -> list[dict]:
  """`summarize`'s rows for the jdist and DDP training sections."""
  picked = [dict(job, sections={k: v for k, v in job.get("sections", {}).items()
                                if k in TRAIN_SECTIONS}) for job in jobs]
  return summarize({"jobs": picked})["rows"]


def rig_targets(summary: dict) -> list[dict]:
  """Issue 25's targets on the rig, each with its measured ratio."""
  name, link, nbytes, bound = ALLREDUCE_TARGET
  out = []
  for row in summary["allreduce"]:
    if (row["link"], row["bytes"]) == (link, nbytes):
      out.append(analysis.target(name, row["jdist_vs_mpi"], bound, f"{link}, 2 nodes x 2"))
  for name, variant, bound in TRAIN_TARGETS:
    for row in summary["training"]:
      if row["variant"] == variant and row["link"] == "1gbit":
        out.append(analysis.target(name, row["comm_vs_reference"], bound, "1gbit, 2 nodes x 2"))
        if row.get("comm_slowest_vs_reference") is not None:
          out.append(analysis.target(name + SLOWEST_NOTE, row["comm_slowest_vs_reference"],
                                     bound, "1gbit, 2 nodes x 2"))
  return out


def rig_summarize(results: dict) -> dict[str, Any]:
  jobs = results["jobs"]
  summary = {"allreduce": rig_allreduce(jobs), "training": rig_training(jobs),
             "failures": analysis.failures(jobs)}
  summary["targets"] = rig_targets(summary)
  return summary


def _allreduce_tables(rows: list[dict]) -> list[str]:
  lines = []
  for link in link_order(rows):
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
  for link in link_order(rows):
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


def rig_markdown(results: dict) -> str:
  """The rig's results.md: method, versions, targets, all-reduce and training tables."""
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
