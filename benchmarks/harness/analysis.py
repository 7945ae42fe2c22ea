"""The suite's analysis: from the jobs' rows to the report's figures and the targets (every ratio
divides two numbers measured interleaved in the same job).
"""

from __future__ import annotations

from typing import Any, Iterable

GB = 1e9
# All-reduce variants that exchange nothing (floors): no bus bandwidth.
NO_EXCHANGE = ("memcpy", "jdist_noop")
# The targets the issue sets (name -> the bound on the measured ratio).
OVERHEAD_BOUND = 1.03
FP16_BYTES_BOUND = 0.5
FP16_TIME_BOUND = 0.6
FP16_MIN_BYTES = 16 << 20
TOPK_COMM_BOUND = 0.3
TOPK_MIN_PARAMS = 5_000_000  # "at 10M params": the ~10M model
BANDWIDTH_BOUND = 0.9  # jdist's bus bandwidth / raw MPI's, at least (one device each)
MULTI_DEVICE_BANDWIDTH_BOUND = 0.8  # the same with several devices per process
BANDWIDTH_MIN_BYTES = 1 << 20


def section_rows(jobs: Iterable[dict], section: str) -> list[dict]:
  """Every row of `section` over all jobs, each tagged with its job's name."""
  rows = []
  for job in jobs:
    for row in job.get("sections", {}).get(section, {}).get("rows", []):
      rows.append(dict(row, job=job["job"]))
  return rows


def _index(rows: list[dict], *keys: str) -> dict[tuple, dict]:
  return {tuple(row[k] for k in keys): row for row in rows}


def bus_bandwidth(row: dict) -> float | None:
  """nccl-tests' bus bandwidth 2(P-1)/P x bytes/time (None: a floor)."""
  if row["variant"] in NO_EXCHANGE:
    return None
  ranks = row.get("participants", row["replicas"])  # older results: every replica
  return row["bytes"] / row["time_s"] / GB * 2 * (ranks - 1) / ranks


def allreduce(jobs: list[dict]) -> list[dict]:
  """Bandwidths, and each variant's time and bus bandwidth against MPI's (same job and size)."""
  rows = section_rows(jobs, "allreduce")
  by_variant = _index(rows, "job", "bytes", "variant")
  out = []
  for row in rows:
    # Chained variants (several all-reduces per call) against MPI's chain.
    baseline = "mpi_x8" if row.get("per_call", 1) > 1 else "mpi"
    mpi = by_variant.get((row["job"], row["bytes"], baseline))
    busbw = bus_bandwidth(row)
    out.append(dict(row, algbw_GBps=row["bytes"] / row["time_s"] / GB, busbw_GBps=busbw,
                    vs_mpi=row["time_s"] / mpi["time_s"] if mpi else None,
                    busbw_vs_mpi=busbw / bus_bandwidth(mpi) if mpi and busbw else None))
  return out


def rank_per_replica(allreduce_rows: list[dict]) -> list[dict]:
  """jdist, several devices per process, against MPI over as many ranks."""
  mpi = {(r["replicas"], r["bytes"], r["per_call"]): r for r in allreduce_rows
         if r["variant"] in ("mpi", "mpi_x8") and r["processes"] == r["replicas"]}
  out = []
  for row in allreduce_rows:
    if row["variant"] in ("jdist_psum", "jdist_psum_x8") and row["replicas"] > row["processes"]:
      other = mpi.get((row["replicas"], row["bytes"], row["per_call"]))
      if other:
        out.append({"job": row["job"], "bytes": row["bytes"], "per_call": row["per_call"],
                    "jdist_s": row["time_s"], "mpi_job": other["job"], "mpi_s": other["time_s"],
                    "ratio": row["time_s"] / other["time_s"]})
  return out


def overhead(jobs: list[dict]) -> list[dict]:
  out = []
  for row in section_rows(jobs, "overhead"):
    nocheck = row.get("jdist_nocheck_time_s")
    shard_map = row.get("shard_map_time_s")
    out.append(dict(row, ratio=row["jdist_time_s"] / row["pmap_time_s"],
                    nocheck_ratio=nocheck / row["pmap_time_s"] if nocheck else None,
                    shard_map_ratio=row["jdist_time_s"] / shard_map if shard_map else None))
  return out


def compression(jobs: list[dict]) -> list[dict]:
  """Per model: communication time (step - compute) and ratios against plain."""
  rows = section_rows(jobs, "compression")
  by_mode = _index(rows, "job", "model", "mode")
  out = []
  for row in rows:
    compute = by_mode[(row["job"], row["model"], "compute")]["time_s"]
    plain = by_mode.get((row["job"], row["model"], "plain"))
    comm = row["time_s"] - compute
    entry = dict(row, compute_s=compute, comm_s=comm)
    if plain is not None and row["mode"] != "compute":
      plain_comm = plain["time_s"] - compute
      entry.update(bytes_ratio=row["wire_bytes"] / plain["wire_bytes"],
                   time_ratio=row["time_s"] / plain["time_s"],
                   comm_ratio=comm / plain_comm if plain_comm > 0 else None)
    out.append(entry)
  return out


def scaling(jobs: list[dict]) -> list[dict]:
  """Samples/s and weak-scaling efficiency against one replica (1x1)."""
  rows = section_rows(jobs, "scaling")
  single = next((r for r in rows if r["replicas"] == 1), None)
  out = []
  for row in rows:
    rate = row["replicas"] * row["per_replica_batch"] / row["time_s"]
    base = single["per_replica_batch"] / single["time_s"] if single else None
    compute = row.get("compute_time_s")
    out.append(dict(row, samples_per_s=rate,
                    efficiency=rate / (row["replicas"] * base) if base else None,
                    comm_share=1 - compute / row["time_s"] if compute else None))
  return out


def backends(jobs: list[dict]) -> dict[str, Any]:
  """Backend "jax" (XLA/gloo collectives) beside the MPI path, and how init went."""
  jax_jobs = [j for j in jobs if j.get("backend") == "jax" or j["job"].endswith("-jax")]
  job = jax_jobs[0] if jax_jobs else {}
  return {"job": job.get("job"), "init_error": job.get("init_error"),
          "error": job.get("error"),
          "workaround": ("jax.distributed.initialize(cluster_detection_method='mpi4py')"
                         if job.get("init_error") else None)}


def target(name: str, measured: float | None, bound: float, where: str, *,
            at_least: bool = False) -> dict:
  """A target row; the measured ratio must be <= bound (>= with at_least)."""
  met = None if measured is None else (measured >= bound if at_least else measured <= bound)
  return {"target": name, "bound": bound, "measured": measured, "where": where,
          "at_least": at_least, "met": met}


def targets(summary: dict[str, Any]) -> list[dict]:
  """Every target of the issue with the measured ratio (lower is better)."""
  out = []
  for row in summary["overhead"]:
    out.append(target("step overhead jdist/pmap (ratio of medians)", row["ratio"],
                       OVERHEAD_BOUND, f"1x{row['devices']} {row['model']}"))
    out.append(target("step overhead jdist/shard_map (ratio of medians)",
                       row.get("shard_map_ratio"), OVERHEAD_BOUND,
                       f"1x{row['devices']} {row['model']}"))
  for row in summary["compression"]:
    if row["mode"] == "fp16":
      out.append(target("fp16 bytes/float32 bytes", row.get("bytes_ratio"), FP16_BYTES_BOUND,
                         f"{row['job']} {row['model']}"))
    if row["mode"].startswith("topk1%") and row["params"] >= TOPK_MIN_PARAMS:
      name = "top-K 1% comm time/dense comm time" + (
          f" ({row['mode']})" if row["mode"] != "topk1%" else "")
      out.append(target(name, row.get("comm_ratio"), TOPK_COMM_BOUND,
                         f"{row['job']} {row['model']}"))
  by_variant = _index(summary["allreduce"], "job", "bytes", "variant")
  for (job, nbytes, variant), row in sorted(by_variant.items()):
    if variant in ("jdist_psum", "jdist_psum_x8") and nbytes >= BANDWIDTH_MIN_BYTES \
        and row.get("busbw_vs_mpi"):
      kind = "8 per step" if variant.endswith("_x8") else "one per call"
      several = row["replicas"] > row["processes"]
      out.append(target(f"all-reduce bus bandwidth jdist/raw MPI ({kind})",
                         row["busbw_vs_mpi"],
                         MULTI_DEVICE_BANDWIDTH_BOUND if several else BANDWIDTH_BOUND,
                         f"{job} {nbytes >> 20} MB", at_least=True))
    f32 = by_variant.get((job, nbytes, "jdist_mean"))
    if variant == "jdist_fp16" and nbytes >= FP16_MIN_BYTES and f32:
      out.append(target("fp16 all-reduce time/float32", row["time_s"] / f32["time_s"],
                         FP16_TIME_BOUND, f"{job} {nbytes >> 20} MB"))
  return out


def failures(jobs: list[dict]) -> list[dict]:
  """Jobs that failed and sections that raised or did not finish."""
  out = []
  for job in jobs:
    if "error" in job:
      out.append({"job": job["job"], "section": None, "error": job["error"]})
    for name, section in job.get("sections", {}).items():
      if "error" in section or not section.get("complete", False):
        last = section["rows"][-1] if section.get("rows") else None
        out.append({"job": job["job"], "section": name, "rows": len(section.get("rows", [])),
                    "error": section.get("error", "did not finish"), "last_row": last})
  return out


def summarize(jobs: list[dict]) -> dict[str, Any]:
  reduce_rows = allreduce(jobs)
  summary = {"allreduce": reduce_rows, "rank_per_replica": rank_per_replica(reduce_rows),
             "overhead": overhead(jobs),
             "compression": compression(jobs),
             "scaling": scaling(jobs), "backends": backends(jobs), "failures": failures(jobs)}
  summary["targets"] = targets(summary)
  return summary


def slowest_per_round(per_process: list[list[float]]) -> list[float]:
  """Round by round, the longest of every process's sample (every process runs the same rounds)."""
  return [max(rounds) for rounds in zip(*per_process)]
