"""The network section on the cluster rig (2 nodes x 2 processes): all-reduce and training steps.

    python -m benchmarks network --on rig [--quick] [--out DIR] [--links 10gbit,1gbit,100mbit]

Writes results.json and results.md (docs/benchmarks/cluster/results.md).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from benchmarks.harness import cluster
from benchmarks.harness import jobs as jobs_lib
from benchmarks.harness import netns
from benchmarks.harness import outputs
from benchmarks.harness import report
from benchmarks.harness.section import torch_missing
from benchmarks.sections.network import rig_allreduce
from benchmarks.sections.network import report as network_report
from benchmarks.sections.network import shaped as network
from benchmarks.sections.network import steps as network_steps

NODES = 2
PROCESSES_PER_NODE = 2
TOPOLOGY = f"{NODES} nodes x {PROCESSES_PER_NODE} x 1"
LINKS = network.RIG_LINKS
SIZES = tuple(1 << 20 << 2 * i for i in range(4))  # 1, 4, 16, 64 MB of float32 per rank
TRAIN_LINKS = ("1gbit", "100mbit")
SKIP_SIZES = {"100mbit": (64 << 20,)}  # about 10 s per all-reduce: left out
TRAIN_MODES = ("plain", "fp16")
TORCH_VARIANTS = ("compute", "ddp", "ddp_fp16")
TRAIN_REPEATS = 10
TRAIN_WARMUP = 3
QUICK_LINKS = ("1gbit",)
QUICK_SIZES = (1 << 20,)
QUICK_MODES = ("plain",)
QUICK_TORCH_VARIANTS = ("compute", "ddp")
JOB_TIMEOUT = 480
QUICK_TIMEOUT = 240
def run_torch(rig: cluster.Cluster, name: str, options: dict, *, timeout: float) -> dict:
  """The torch peer under one `torchrun` per node of the rig."""
  master = rig.nodes[0]
  port = dict(netns.gloo_env())["MASTER_PORT"]
  job = jobs_lib.Job(name, NODES * PROCESSES_PER_NODE, 1, (), options=tuple(options.items()),
                     program="torch_peer")
  env = dict(jobs_lib.environment(job), **cluster.RANK_ENV, GLOO_SOCKET_IFNAME=master.inner_veth,
             OMP_NUM_THREADS="1")
  torchrun = [jobs_lib.binary("torchrun"), "--nnodes", str(NODES), "--nproc-per-node",
              str(PROCESSES_PER_NODE), "--master-addr", master.address, "--master-port", port]
  result = jobs_lib.collect(job, lambda prefix: jobs_lib.launch(
      [rig.node_argv(node.index, torchrun + ["--node-rank", str(node.index)]
                     + jobs_lib.program_argv(job, prefix, False)[1:]) for node in rig.nodes],
      env, timeout))
  for row in result.get("sections", {}).get("torch", {}).get("rows", []):
    if row["variant"] == "compute":
      row["variant"] = "torch_compute"
  return result


def link_plan(link: str, quick: bool, repeats: int | None) -> tuple[list, dict]:
  """The worker measurements (modules) and options of `link`'s jdist job."""
  rate = netns.link_named(link).rate_mbit
  sizes = QUICK_SIZES if quick else tuple(s for s in SIZES
                                          if s not in SKIP_SIZES.get(link, ()))
  options: dict[str, Any] = {"sizes": list(sizes), "rate_mbit": rate}
  sections: list = [rig_allreduce]
  if link in TRAIN_LINKS or quick:
    sections.append(network_steps)
    options.update(modes=list(QUICK_MODES if quick else TRAIN_MODES), handwritten=False,
                   floor=False, repeats=repeats or TRAIN_REPEATS, warmup=TRAIN_WARMUP)
  return sections, options


def run_link(link: str, *, quick: bool, repeats: int | None, with_torch: bool,
             log: Callable[[str], None]) -> list[dict]:
  """Every job of one per-node link rate, on a fresh rig."""
  sections, options = link_plan(link, quick, repeats)
  timeout = QUICK_TIMEOUT if quick else JOB_TIMEOUT
  results = []
  with cluster.Cluster(nodes=NODES, rate_mbit=options["rate_mbit"]) as rig:
    name = f"jdist@{link}"
    hosts = ', '.join(n.hostname for n in rig.nodes)
    log(f"[{name}] {' '.join(m.NAME for m in sections)} on {hosts} ...")
    job = jobs_lib.Job(name, NODES * PROCESSES_PER_NODE, 1, tuple(sections),
                       options=tuple(options.items()))
    results.append(cluster.run_job(rig, job, quick=quick, timeout=timeout))
    if with_torch and network_steps in sections:
      name = f"torch@{link}"
      log(f"[{name}] DDP under torchrun --nnodes {NODES} ...")
      torch_options = {"variants": list(QUICK_TORCH_VARIANTS if quick else TORCH_VARIANTS),
                       "per_process_batch": 64, "repeats": options["repeats"],
                       "warmup": options["warmup"]}
      results.append(run_torch(rig, name, torch_options, timeout=timeout))
  for result in results:
    log(f"[{result['job']}] done in {result['wall_s']:.0f} s"
        + (f": FAILED {result['error'][:300]}" if "error" in result else ""))
    result.update(link=link, topology_name=TOPOLOGY)
  return results


def run_all(links=None, *, quick: bool = False, repeats: int | None = None,
            log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs every link's jobs; returns the results with their summary."""
  start, environment = time.perf_counter(), report.environment()
  links = list(links or (QUICK_LINKS if quick else LINKS))
  skipped = cluster.missing_requirements()
  if skipped:
    skipped, links = ["the cluster rig cannot be built here: " + "; ".join(skipped)], []
  skipped += [reason] if (reason := torch_missing()) else []
  for line in skipped:
    log(f"[cluster] SKIPPED {line}")
  cluster.remove_stale()
  results = []
  for link in links:
    results += run_link(link, quick=quick, repeats=repeats, with_torch=reason is None, log=log)
  out = report.results("python -m benchmarks network --on rig" + (" --quick" if quick else ""),
                       environment, start, quick=quick, skipped=skipped, links=links,
                       topology=TOPOLOGY, jobs=results)
  out["summary"] = network_report.rig_summarize(out)
  return out


def write_outputs(results: dict, out_dir: str) -> list[str]:
  """results.json and results.md into `out_dir`; returns the files written."""
  return outputs.write_report(out_dir, results, network_report.rig_markdown,
                              json_name="results.json", md_name="results.md")


# The same options and checks as on shaped links (`--topologies` and `--modes` refused).
add_arguments = network.add_arguments
check = network.check


def main(args: argparse.Namespace) -> int:
  return network.run_main(args, lambda: run_all(args.links, quick=args.quick,
                                                repeats=args.repeats),
                          network_report.rig_summarize, write_outputs)
