"""The network section on the cluster rig: `python -m benchmarks network --on rig`.

    python -m benchmarks network --on rig [--quick] [--out DIR] [--links 10gbit,1gbit,100mbit]

Per node link rate, a fresh 2 nodes x 2 processes rig runs the worker with
`rig_allreduce` and, on `TRAIN_LINKS`, `steps` (jdist plain and fp16), then DDP under
one `torchrun --nnodes 2` per node. Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
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


def run_job(rig: cluster.Cluster, job: jobs_lib.Job, *, quick: bool, timeout: float) -> dict:
  """`job` under `mpirun --hostfile` on the rig, its processes split evenly over the nodes.

  The ranks get `RANK_ENV`; the job's own `env` wins over it.
  """
  env = {**jobs_lib.environment(job), **RANK_ENV, **dict(job.env), **rig.mpi_env()}
  names = dict.fromkeys([*RANK_ENV, *dict(job.env), *FORWARDED])
  extra = [arg for key in names for arg in ("-x", key)]
  return jobs_lib.collect(job, lambda prefix: jobs_lib.launch(rig.mpirun_argv(
      jobs_lib.program_argv(job, prefix, quick), job.processes // len(rig.nodes),
      jobs_lib.binary("mpirun"), extra), env, timeout))


def _stop(procs: list[subprocess.Popen]) -> None:
  for proc in procs:
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGKILL)


def run_torch(rig: cluster.Cluster, name: str, options: dict, *, timeout: float) -> dict:
  """`benchmarks.harness.torch_peer` under one `torchrun` per node, DDP over gloo on the rig.

  The peer's compute-only variant is renamed `torch_compute`, as
  `benchmarks.sections.network.steps` names it, so `network_report` pairs the rows.
  """
  master = rig.nodes[0]
  port = str(network.free_port())
  job = jobs_lib.Job(name, NODES * PROCESSES_PER_NODE, 1, (), options=tuple(options.items()),
                     program="torch_peer")
  env = dict(jobs_lib.environment(job), **RANK_ENV, GLOO_SOCKET_IFNAME=master.inner_veth,
             OMP_NUM_THREADS="1")

  def start(prefix: str) -> str | None:
    procs = []
    for node in rig.nodes:
      command = [jobs_lib.binary("torchrun"), "--nnodes", str(NODES), "--nproc-per-node",
                 str(PROCESSES_PER_NODE), "--node-rank", str(node.index), "--master-addr",
                 master.address, "--master-port", port] + jobs_lib.program_argv(
                     job, prefix, False)[1:]
      procs.append(subprocess.Popen(rig.node_argv(node.index, command), env=env,
                                    cwd=jobs_lib.REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
      for proc in procs:
        output = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        if proc.returncode != 0:
          return f"exit status {proc.returncode}:\n" + output.decode(errors="replace")[-3000:]
      return None
    except subprocess.TimeoutExpired:
      return f"timed out after {timeout:.0f} s"
    finally:
      _stop(procs)

  result = jobs_lib.collect(job, start)
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
    results.append(run_job(rig, job, quick=quick, timeout=timeout))
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
  skipped = cluster.missing_requirements()
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
  return network.run_main(args, lambda: run_all(args.links, quick=args.quick, repeats=args.repeats),
                          cluster_report.summarize, write_outputs)
