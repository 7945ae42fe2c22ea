"""Network section: jdist against PyTorch DDP on emulated cluster links.

    python -m benchmarks network [--quick] [--out DIR] [--links shm,1gbit] [--topologies 2x1]

Per link of `netns.LINKS` (shm: no namespace) and topology (2x1, 2x2), one job
(`steps`) times jdist's modes, a hand-written mpi4jax step, raw MPI and DDP interleaved
in the same processes. What this machine cannot run is skipped with the reason. Writes
network.json, network.md and network.png (method: docs/benchmarks/network.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import socket
import sys
import time
from typing import Any, Callable

from benchmarks.harness import jobs as jobs_lib
from benchmarks.harness import netns
from benchmarks.harness import outputs
from benchmarks.harness import plots
from benchmarks.harness import report
from benchmarks.harness.section import UsageError
from benchmarks.sections.network import report as network_report
from benchmarks.sections.network import steps as network_steps

TOPOLOGIES = {"2x1": (2, 1), "2x2": (2, 2)}
QUICK_LINKS = ("1gbit",)
RIG_LINKS = ("10gbit", "1gbit", "100mbit")  # --on rig (benchmarks.sections.network.rig)
QUICK_TOPOLOGIES = ("2x1",)
QUICK_MODES = ("plain", "fp16")  # the smoke run: one compressed mode beside plain
TORCH_VARIANTS = ("compute", "ddp", "ddp_fp16", "ddp_powersgd")  # benchmarks.harness.torch_peer's
QUICK_TORCH_VARIANTS = ("compute", "ddp")
REPEATS = 15
WARMUP = 3
JOB_TIMEOUT = 480  # seconds per job; a hang must not block the run
TORCH_INSTALL_HINT = "pip install -e '.[torch-peer]' (torch==2.13.0, the CPU build)"


def torch_missing() -> str | None:
  """Why the PyTorch peer cannot run here, or None."""
  if importlib.util.find_spec("torch") is None:
    return f"torch is not installed: the DDP peer is skipped ({TORCH_INSTALL_HINT})"
  return None


def free_port() -> int:
  """A TCP port free on this namespace's loopback (for gloo's rendezvous)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def gloo_env() -> tuple[tuple[str, str], ...]:
  """A job's environment for torch.distributed's gloo rendezvous on the loopback."""
  return (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())),
          ("GLOO_SOCKET_IFNAME", "lo"))


def link_namespace(link: netns.Link):
  """A context yielding `link`'s fresh shaped namespace, or None for shared memory."""
  return netns.shaped_namespace(link) if link.shaped else contextlib.nullcontext()


def in_namespace(job: jobs_lib.Job, name: str | None) -> jobs_lib.Job:
  """`job` run inside namespace `name` with MPI over its loopback (None: as it is)."""
  if name is None:
    return job
  return dataclasses.replace(job, prefix=tuple(netns.exec_prefix(name)),
                             mpirun_args=netns.MPI_TCP_ARGS)


def available_links(links) -> tuple[list[netns.Link], list[str]]:
  """The links of `links` this machine can emulate, and why the others cannot run.

  Returns:
    `(links, skipped)`: shaped links are dropped without root / `ip` / `tc`,
    links with a delay without netem; `skipped` holds one sentence per reason.
  """
  chosen, skipped = list(links), []
  missing = netns.missing_requirements() if any(l.shaped for l in chosen) else []
  if missing:
    skipped.append("shaped links skipped: " + "; ".join(missing))
    chosen = [l for l in chosen if not l.shaped]
  if any(l.delay_ms for l in chosen) and not netns.netem_available():
    skipped.append("links with a delay skipped: this kernel has no netem qdisc (sch_netem); "
                   "tc cannot add latency here")
    chosen = [l for l in chosen if not l.delay_ms]
  return chosen, skipped


def cell_job(topology: str, link: netns.Link, *, quick: bool, repeats: int,
             with_torch: bool, modes=None) -> jobs_lib.Job:
  """The job of one link and topology: jdist's variants and (with torch) DDP's."""
  processes, devices = TOPOLOGIES[topology]
  options = {"repeats": repeats, "warmup": WARMUP}
  if quick or modes:
    options["modes"] = list(modes or QUICK_MODES)
  env = ()
  if with_torch:
    options["torch"] = list(QUICK_TORCH_VARIANTS if quick else TORCH_VARIANTS)
    env += gloo_env()
  return jobs_lib.Job(f"{topology}@{link.name}", processes, devices, (network_steps,), env=env,
                      options=tuple(options.items()))


def run_link(link: netns.Link, topologies, *, quick: bool, repeats: int, with_torch: bool,
             log: Callable[[str], None], modes=None) -> list[dict]:
  """Every job of `link`, in one namespace (none for shared memory)."""
  results = []
  with link_namespace(link) as name:
    for topology in topologies:
      job = in_namespace(cell_job(topology, link, quick=quick, repeats=repeats,
                                  with_torch=with_torch, modes=modes), name)
      result = jobs_lib.run(job, quick=quick, timeout=JOB_TIMEOUT, log=log)
      results.append(dict(result, link=link.name, topology_name=topology))
  return results


def environment() -> dict[str, Any]:
  env = report.environment()
  try:
    import torch  # pylint: disable=import-outside-toplevel
    env["versions"]["torch"] = torch.__version__
  except ImportError:
    env["versions"]["torch"] = "not installed"
  env["kernel"] = platform.release()
  return env


def run_network(links=None, topologies=None, *, quick: bool = False, repeats: int | None = None,
                modes=None, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Runs the network section and returns its results (summary included).

  Args:
    links: link names (default every one of `netns.LINKS`; quick: 1gbit).
    topologies: "2x1" and/or "2x2" (default both; quick: 2x1).
    quick: smoke run: few modes, 3 timed rounds.
    repeats: timed rounds per variant (default `REPEATS`).
    modes: jdist modes (default every one of `steps.MODES`).
    log: progress lines.
  """
  start = time.perf_counter()
  environment_info = environment()  # load average at the start
  names = links or (QUICK_LINKS if quick else [link.name for link in netns.LINKS])
  topologies = topologies or (QUICK_TOPOLOGIES if quick else tuple(TOPOLOGIES))
  chosen, skipped = available_links(netns.link_named(name) for name in names)
  torch_reason = torch_missing()
  if torch_reason:
    skipped.append(torch_reason)
  for reason in skipped:
    log(f"[network] SKIPPED {reason}")
  netns.remove_stale()
  results = []
  for link in chosen:
    results += run_link(link, topologies, quick=quick, repeats=repeats or REPEATS,
                        with_torch=torch_reason is None, log=log, modes=modes)
  environment_info["load_average_end"] = list(os.getloadavg())
  out = {"command": "python -m benchmarks network" + (" --quick" if quick else ""),
         "quick": quick, "environment": environment_info, "skipped": skipped, "jobs": results,
         "links": [dataclasses.asdict(l) for l in chosen], "wall_s": time.perf_counter() - start}
  out["summary"] = network_report.summarize(out)
  return out


def write_outputs(results: dict, out_dir: str) -> list[str]:
  """network.json, network.md and the figure; returns the files written."""
  os.makedirs(out_dir, exist_ok=True)
  figure = plots.network(results["summary"], out_dir)
  results["figures"] = [figure] if figure else []
  written = outputs.write_report(out_dir, results, network_report.markdown,
                                 json_name="network.json", md_name="network.md")
  return written + [f"{name}.png" for name in results["figures"]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Options of the network section in both places (`--on shaped`, `--on rig`)."""
  parser.add_argument("--links", help="comma-separated: shaped from "
                      + ",".join(link.name for link in netns.LINKS) + "; rig from "
                      + ",".join(RIG_LINKS))
  parser.add_argument("--repeats", type=int, help=f"timed rounds (default {REPEATS}; rig: "
                      "training rounds)")
  parser.add_argument("--render", metavar="JSON", help="measure nothing: re-derive the summary "
                      "of a results JSON and rewrite its report (and figure) into --out")
  parser.add_argument("--topologies", help="shaped only: comma-separated, from "
                      + ",".join(TOPOLOGIES))
  parser.add_argument("--modes", help="shaped only: comma-separated jdist modes (default all: "
                      "plain, fp16, bf16, topk1%%, topk1%%-block, threshold, partial4, powersgd4, "
                      "powersgd1)")


def check(args: argparse.Namespace) -> None:
  if args.on == "rig":
    if args.topologies or args.modes:
      raise UsageError("--topologies and --modes: only with --on shaped")
    if args.links and set(args.links.split(",")) - set(RIG_LINKS):
      raise UsageError(f"--links: choose from {list(RIG_LINKS)}")
    args.links = args.links.split(",") if args.links else None
    return
  try:
    args.links = [netns.link_named(n).name for n in args.links.split(",")] if args.links else None
  except ValueError as err:
    raise UsageError(str(err)) from err
  if args.topologies and set(args.topologies.split(",")) - set(TOPOLOGIES):
    raise UsageError(f"--topologies: choose from {list(TOPOLOGIES)}")
  args.topologies = args.topologies.split(",") if args.topologies else None


def render(path: str, summarize: Callable[[dict], dict],
           write: Callable[[dict, str], list[str]], out_dir: str) -> None:
  """`--render`: re-derives the summary of the results JSON at `path` and rewrites
  its report with `write` into `out_dir`, measuring nothing."""
  with open(path, encoding="utf-8") as f:
    results = json.load(f)
  results["summary"] = summarize(results)
  print(f"Rewrote {', '.join(write(results, out_dir))} into {out_dir}.")


def main(args: argparse.Namespace) -> int:
  """`python -m benchmarks network --on shaped` (`--on rig`: `benchmarks.sections.network.rig`)."""
  return run_main(args, lambda: run_network(
      args.links, args.topologies, quick=args.quick, repeats=args.repeats,
      modes=args.modes.split(",") if args.modes else None), network_report.summarize,
                  write_outputs)


def run_main(args: argparse.Namespace, measure: Callable[[], dict],
             summarize: Callable[[dict], dict], write: Callable[[dict, str], list[str]]) -> int:
  """`--render` (`render`), or `measure()`'s results written and their targets printed."""
  if args.render:
    render(args.render, summarize, write, args.out)
    return 0
  netns.terminate_on_sigterm()  # so a killed run still deletes its namespaces or rig
  results = measure()
  results["command"] = args.command
  print_outcome(results, write(results, args.out), args.out)
  return 0


def print_outcome(results: dict, written: list[str], out_dir: str) -> None:
  """Prints each target's verdict, each failed job and what was written."""
  report.print_targets(results["summary"]["targets"])
  for failure in results["summary"]["failures"]:
    print(f"FAILURE in job {failure['job']}: {str(failure['error']).splitlines()[0][:200]}",
          file=sys.stderr)
  print(f"Wrote {', '.join(written)} into {out_dir} in {results['wall_s']:.0f} s.")
