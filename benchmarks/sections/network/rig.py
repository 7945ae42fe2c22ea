"""The network section on the cluster rig: `python -m benchmarks network --on rig`.

    python -m benchmarks network --on rig [--quick] [--out DIR] [--links 10gbit,1gbit,100mbit]

For each per-node link rate, a fresh rig of 2 nodes x 2 processes x 1 device
(`benchmarks.harness.cluster`) runs one `mpirun --hostfile` job of the worker
with `benchmarks.sections.network.rig_allreduce` and, on `TRAIN_LINKS`,
`benchmarks.sections.network.steps` (jdist plain and fp16 beside a compute-only
step); then, on `TRAIN_LINKS`, PyTorch DDP (`benchmarks.harness.torch_peer`)
under one `torchrun --nnodes 2` per node, as a cluster launches it. The two jobs
run one after the other; each side's exposed exchange is its step minus its own
compute-only step of the round. Writes results.json and results.md
(`benchmarks.sections.network.rig_report`) into --out (default
docs/benchmarks/cluster); without root, `ip`, `tc` or `unshare` every part is
skipped with the reason, without torch the DDP part.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from benchmarks.harness import cluster
from benchmarks.harness import jobs as jobs_lib
from benchmarks.harness import netns
from benchmarks.harness import outputs
from benchmarks.sections.network import rig_allreduce
from benchmarks.sections.network import rig_report as cluster_report
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
# The ranks' environment on the rig. jdist's JAX distributed runtime stays off
# (its coordinator address does not resolve on the rig yet). Open MPI yields
# the core while it waits: each rig node believes it has the machine's cores
# to itself, so Open MPI busy-polls, and 4 spinning ranks on 2 shared cores
# starve the ranks they wait for (measured at 1 Gbit/s per node: 1 MB
# all-reduce 150 ms spinning against 22.5 ms yielding, 4 MB 1,168 against
# 71 ms). On a real cluster each rank has its own core and spinning is free.
RANK_ENV = {"JDIST_JAX_DISTRIBUTED": "0", "OMPI_MCA_mpi_yield_when_idle": "1"}
FORWARDED = ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH", "PYTHONUNBUFFERED", "JDIST_TIMEOUT")


def missing() -> list[str]:
  """Why the rig cannot be built here (empty: it can)."""
  return cluster.missing_requirements()


def rank_environment() -> dict[str, str]:
  """The environment of every rank: one device, the repo on the path, `RANK_ENV`."""
  job = jobs_lib.Job(TOPOLOGY, NODES * PROCESSES_PER_NODE, 1, ())
  return dict(jobs_lib.environment(job), **RANK_ENV)


def _read_ranks(prefix: str) -> list[dict]:
  ranks = []
  for path in sorted(glob.glob(prefix + ".rank*.json")):
    with open(path, encoding="utf-8") as f:
      ranks.append(json.load(f))
  return ranks


def _result(name: str, ranks: list[dict], failure: str | None, start: float) -> dict:
  """One job's merged result (`jobs.merge_ranks`), with an error if it failed."""
  expected = NODES * PROCESSES_PER_NODE
  result = jobs_lib.merge_ranks(ranks) if len(ranks) == expected else {"job": name,
                                                                       "sections": {}}
  result["job"] = name
  if failure is not None:
    result["error"] = failure
  elif len(ranks) != expected:
    result["error"] = f"{len(ranks)} of {expected} ranks wrote results"
  result["wall_s"] = time.perf_counter() - start
  return result


def run_jdist(rig: cluster.Cluster, name: str, sections: list, options: dict, *,
              quick: bool, timeout: float) -> dict:
  """`benchmarks.harness.worker` with `sections` under `mpirun --hostfile` on the rig."""
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="jdist-cluster-bench-") as tmp:
    prefix = os.path.join(tmp, "result")
    config = json.dumps({"job": name, "sections": [m.__name__ for m in sections], "quick": quick,
                         "options": options})
    worker = [sys.executable, "-m", "benchmarks", "worker", "--out", prefix, "--config", config]
    extra = [arg for key in list(RANK_ENV) + list(FORWARDED) for arg in ("-x", key)]
    argv = rig.mpirun_argv(worker, PROCESSES_PER_NODE, jobs_lib.mpirun_binary(), extra)
    env = dict(rank_environment(), **rig.mpi_env())
    failure = jobs_lib.launch(argv, env, timeout)
    ranks = _read_ranks(prefix)
  return _result(name, ranks, failure, start)


def torchrun_binary() -> str:
  here = os.path.join(os.path.dirname(sys.executable), "torchrun")
  return here if os.path.exists(here) else (shutil.which("torchrun") or "torchrun")


def _stop(procs: list[subprocess.Popen]) -> None:
  for proc in procs:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGKILL)


def run_torch(rig: cluster.Cluster, name: str, options: dict, *, timeout: float) -> dict:
  """`benchmarks.harness.torch_peer` under one `torchrun` per node, DDP over gloo on the rig.

  The peer's compute-only variant is renamed `torch_compute`, as
  `benchmarks.sections.network.steps` names it, so `network_report` pairs the rows.
  """
  start = time.perf_counter()
  master = rig.nodes[0]
  port = str(network.free_port())
  env = dict(rank_environment(), GLOO_SOCKET_IFNAME=master.inner_veth, OMP_NUM_THREADS="1")
  procs, failure = [], None
  with tempfile.TemporaryDirectory(prefix="jdist-cluster-torch-") as tmp:
    prefix = os.path.join(tmp, "result")
    config = json.dumps({"job": name, "options": options})
    for node in rig.nodes:
      command = [torchrun_binary(), "--nnodes", str(NODES), "--nproc-per-node",
                 str(PROCESSES_PER_NODE), "--node-rank", str(node.index), "--master-addr",
                 master.address, "--master-port", port, "-m", "benchmarks", "torch_peer",
                 "--out", prefix, "--config", config]
      procs.append(subprocess.Popen(rig.node_argv(node.index, command), env=env,
                                    cwd=jobs_lib.REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
      outputs = [proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                 for proc in procs]
      bad = [(p, o) for p, o in zip(procs, outputs) if p.returncode != 0]
      if bad:
        failure = f"exit status {bad[0][0].returncode}:\n" + bad[0][1].decode(
            errors="replace")[-3000:]
    except subprocess.TimeoutExpired:
      failure = f"timed out after {timeout:.0f} s"
    finally:
      _stop(procs)
    ranks = _read_ranks(prefix)
  for rank in ranks:
    for row in rank["sections"].get("torch", {}).get("rows", []):
      if row["variant"] == "compute":
        row["variant"] = "torch_compute"
  return _result(name, ranks, failure, start)


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
    results.append(run_jdist(rig, name, sections, options, quick=quick, timeout=timeout))
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
  start = time.perf_counter()
  environment = network.environment()  # versions (torch included), load at the start
  links = list(links or (QUICK_LINKS if quick else LINKS))
  skipped = missing()
  if skipped:
    skipped = ["the cluster rig cannot be built here: " + "; ".join(skipped)]
    links = []
  torch_reason = network.torch_missing()
  if torch_reason:
    skipped.append(torch_reason)
  for reason in skipped:
    log(f"[cluster] SKIPPED {reason}")
  cluster.remove_stale()
  results = []
  for link in links:
    results += run_link(link, quick=quick, repeats=repeats, with_torch=torch_reason is None,
                        log=log)
  environment["load_average_end"] = list(os.getloadavg())
  out = {"command": "python -m benchmarks network --on rig" + (" --quick" if quick else ""),
         "quick": quick, "environment": environment, "skipped": skipped, "links": links,
         "topology": TOPOLOGY, "jobs": results, "wall_s": time.perf_counter() - start}
  out["summary"] = cluster_report.summarize(out)
  return out


def write_outputs(results: dict, out_dir: str) -> list[str]:
  """results.json and results.md into `out_dir`; returns the files written."""
  return outputs.write_report(out_dir, results, cluster_report.markdown,
                              json_name="results.json", md_name="results.md")


# The same options and checks as on shaped links (`--topologies` and `--modes` refused).
add_arguments = network.add_arguments
check = network.check


def main(args: argparse.Namespace) -> int:
  if args.render:
    network.render(args.render, cluster_report.summarize, write_outputs, args.out)
    return 0
  netns.terminate_on_sigterm()  # a killed run still tears its rig down
  results = run_all(args.links, quick=args.quick, repeats=args.repeats)
  results["command"] = args.command
  network.print_outcome(results, write_outputs(results, args.out), args.out)
  return 0
