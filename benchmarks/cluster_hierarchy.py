"""Node-aware vs flat native sums vs Open MPI's MPI_Allreduce, on the cluster rig.

    sudo .venv/bin/python -m benchmarks hierarchy --sizes-mb 1,4,16,64 \
        --rate-mbit 1000 --out docs/benchmarks/cluster/hierarchy.json

Builds a rig of `--nodes` nodes (`benchmarks.cluster`, root needed) with
`--per-node` processes x 1 device on each, and runs this module as the job.
In one job, for each float32 size, these run alternated round by round:

  * `mpi`: mpi4py `Allreduce` between numpy buffers on a communicator of its
    own (Open MPI's own choice of algorithm for this size and rank count);
  * `jdist_hierarchical`: `jdist.psum` in a `jdist.data_parallel` step on the
    native route with node-aware sums (`native.set_hierarchical(True)`);
  * `jdist_flat`: the same step with flat sums (`set_hierarchical(False)`);
  * with `--segments 4194304,...`: `jdist_hierarchical_seg<bytes>`, the
    node-aware step in segments of that many bytes (`set_segment_bytes`)
    instead of the default (256 KiB for node-aware sums).

Each call starts after a barrier; its time is the slowest rank's; rank 0
also reads its node's link counters around each call (`link_mib_out`,
`link_mib_in`: MiB per call that crossed the node's link, which tells which
algorithm Open MPI ran). With
`--link-probe`, the rig's link is measured first for each size (`tcp_link`
rows: `--per-node` TCP streams each way at once between two nodes, the
size's bytes per node and direction, as a node-aware sum moves them;
`benchmarks.cluster_link`): the floor the node-aware sum and Open MPI are
held to, TCP's own overhead and the shaper's behaviour included. Prints
one JSON row per variant and size (median, min, max seconds) and writes
them to `--out`. `--mpi-yield` sets `OMPI_MCA_mpi_yield_when_idle=1`: on a
machine with fewer cores than the rig's processes, Open MPI's busy-polling
waits otherwise take the cores its peers need (the native engine backs off
when idle).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

_NIC = "/sys/class/net/eth0/statistics"  # the node's link, inside its namespace


def _link_bytes() -> tuple[int, int]:
  """Bytes this node's link sent and received so far (0, 0 off the rig)."""
  try:
    return tuple(int(open(f"{_NIC}/{name}_bytes", encoding="ascii").read())
                 for name in ("tx", "rx"))
  except OSError:
    return 0, 0


def _worker(sizes_mb: list[float], repeats: int, segments: list[int]) -> None:
  """The job: every rank times every variant, alternated; rank 0 prints rows."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from mpi4py import MPI  # pylint: disable=import-outside-toplevel

  import jdist  # pylint: disable=import-outside-toplevel
  from jdist import collectives  # pylint: disable=import-outside-toplevel
  from jdist.collectives import native  # pylint: disable=import-outside-toplevel

  topo = jdist.init()
  comm = MPI.COMM_WORLD.Dup()
  assert collectives.route() == "native", collectives.route()
  native.set_hierarchical(True)  # raises where the engine has no node map
  step = jdist.data_parallel(jdist.psum)
  start_segments = native.set_segment_bytes(None)  # $JDIST_NATIVE_SEGMENT_BYTES or None
  native.set_segment_bytes(start_segments)
  for size_mb in sizes_mb:
    count = int(size_mb * (1 << 20)) // 4
    src = np.random.default_rng(topo.process_index).random(count, dtype=np.float32)
    dst = np.empty_like(src)
    buffer = jdist.replicate(jnp.asarray(src))

    def jdist_call(hierarchical: bool, segment_bytes: int | None = None):
      native.set_hierarchical(hierarchical)
      native.set_segment_bytes(segment_bytes or start_segments)
      return jax.block_until_ready(step(buffer))

    calls = {"mpi": lambda: comm.Allreduce(src, dst, op=MPI.SUM),
             "jdist_hierarchical": lambda: jdist_call(True),
             "jdist_flat": lambda: jdist_call(False)}
    for nbytes in segments:  # node-aware sums in segments of another size
      calls[f"jdist_hierarchical_seg{nbytes}"] = lambda n=nbytes: jdist_call(True, n)
    times: dict[str, list[float]] = {name: [] for name in calls}
    link = {name: np.zeros(2) for name in calls}  # node 0's bytes out, in
    results = {}
    for round_index in range(repeats + 1):  # round 0 warms up (compiles), untimed
      for name in calls:
        comm.Barrier()
        before = _link_bytes()
        start = time.perf_counter()
        out = calls[name]()
        elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if round_index:
          times[name].append(elapsed)
          link[name] += np.subtract(_link_bytes(), before)
        else:
          results[name] = np.asarray(out if name != "mpi" else dst).reshape(-1).copy()
    for name in list(calls)[1:]:
      np.testing.assert_allclose(results[name], results["mpi"], rtol=1e-5)
    if topo.process_index == 0:
      for name in calls:
        values = sorted(times[name])
        print(json.dumps({"variant": name, "mbytes": size_mb, "processes": topo.process_count,
                          "nodes": topo.node_count, "median_s": values[len(values) // 2],
                          "min_s": values[0], "max_s": values[-1], "repeats": len(values),
                          # per call, headers included (a barrier's few bytes too)
                          "link_mib_out": link[name][0] / len(values) / (1 << 20),
                          "link_mib_in": link[name][1] / len(values) / (1 << 20)}),
              flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--sizes-mb", default="1,4,16,64")
  parser.add_argument("--rate-mbit", type=float, default=1000)
  parser.add_argument("--nodes", type=int, default=2)
  parser.add_argument("--per-node", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--segments", default="",
                      help="comma-separated segment bytes: node-aware variants "
                           "(jdist_hierarchical_seg<bytes>) beside the default's")
  parser.add_argument("--mpi-yield", action="store_true",
                      help="OMPI_MCA_mpi_yield_when_idle=1: Open MPI's waits yield the CPU "
                           "(for a rig with fewer cores than processes)")
  parser.add_argument("--link-probe", action="store_true",
                      help="first time TCP streams between the nodes (tcp_link rows)")
  parser.add_argument("--out", default=None)
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
  sizes = [float(s) for s in args.sizes_mb.split(",")]
  if args.worker:
    _worker(sizes, args.repeats, [int(n) for n in args.segments.split(",") if n])
    return 0
  from benchmarks import cluster  # pylint: disable=import-outside-toplevel
  from tests import launch  # pylint: disable=import-outside-toplevel
  missing = cluster.missing_requirements()
  if missing:
    print("cluster_hierarchy: the rig cannot be built here: " + "; ".join(missing))
    return 2
  command = [sys.executable, "-m", "benchmarks", "hierarchy", "--worker",
             "--sizes-mb", args.sizes_mb, "--repeats", str(args.repeats),
             "--segments", args.segments]
  env = {"OMPI_MCA_mpi_yield_when_idle": "1"} if args.mpi_yield else {}
  link_rows = []
  with cluster.Cluster(nodes=args.nodes, rate_mbit=args.rate_mbit) as rig:
    if args.link_probe:
      from benchmarks import cluster_link  # pylint: disable=import-outside-toplevel
      for size in sizes:
        values = sorted(cluster_link.measure(rig, size / args.per_node, args.per_node)
                        for _ in range(3))
        link_rows.append({"variant": "tcp_link", "mbytes": size, "median_s": values[1],
                          "min_s": values[0], "max_s": values[-1], "repeats": 3,
                          "streams_per_direction": args.per_node})
    process = rig.popen(command, args.per_node, mpirun=launch.mpirun_binary(),
                        env=launch.clean_env(1, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True, cwd=launch.REPO)
    stdout, stderr = process.communicate(timeout=3600)
  if process.returncode != 0:
    print(stderr[-3000:], file=sys.stderr)
    return process.returncode
  rows = link_rows + [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
  for row in rows:
    row.update(rate_mbit=args.rate_mbit, mpi_yield_when_idle=args.mpi_yield)
  by_size: dict[float, dict[str, float]] = {}
  for row in rows:
    by_size.setdefault(row["mbytes"], {})[row["variant"]] = row["median_s"]
  shown = list(dict.fromkeys(row["variant"] for row in rows))
  print(f"{'MB':>5} " + " ".join(f"{name[-19:]:>19}" for name in shown) +
        "   hier/mpi  hier/flat")
  for size, medians in by_size.items():
    print(f"{size:>5g} " + " ".join(f"{medians[name] * 1e3:>16.1f} ms" for name in shown) +
          f"   {medians['jdist_hierarchical'] / medians['mpi']:8.2f}"
          f"  {medians['jdist_hierarchical'] / medians['jdist_flat']:8.2f}")
  for row in rows:
    if "link_mib_out" in row:
      print(f"{row['mbytes']:>5g} MB {row['variant']}: {row['link_mib_out']:.2f} MiB out, "
            f"{row['link_mib_in']:.2f} MiB in per call on node 0's link")
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
      json.dump(rows, handle, indent=1)
  return 0
