"""The network section's analysis (ratios, targets, best mode per link) and network.md.

comm = the median over rounds of a step minus its own side's compute-only step in the
same round (`comm_of_medians_s`: the medians' difference; `comm_slowest_s`: against the
slowest process's); raw MPI rows are all communication. Method: docs/benchmarks/network.md.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import analysis
from benchmarks.harness import netns
from benchmarks.harness import report

# The targets: (name, variant, reference variant or None for the
# reference's own plain, measure "comm"/"step", {link: bound}).
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
  """a / b for times; a time below zero (a hidden exchange, within noise) counts
  as zero, and a positive time against a fully hidden one is infinitely worse."""
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
    ddp = by_key.get(cell + ("ddp",))
    ddp_half = by_key.get(cell + ("ddp_fp16",))
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
        # pylint: disable-next=protected-access
        target = analysis._target(name, value, bound, f"{topology} {link}")
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
  for other in summary["rows"]:
    if (other["link"], other["topology"], other["variant"]) == (
        row["link"], row["topology"], variant):
      return other["step_s"]
  return None


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
