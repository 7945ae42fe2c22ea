"""The benchmark suite's smoke run: `python -m benchmarks --quick`.

It starts its own jobs (plain processes and `mpirun -np 2`), so it runs from
plain pytest only; under `mpirun pytest` it passes without launching anything.
"""

import json
import os

import pytest

from benchmarks.harness import analysis
from tests import launch

SECTIONS = ("allreduce", "overhead", "compression", "scaling")
# Every job of the smoke run and the sections it must fill.
JOBS = {"1x1": {"scaling"}, "1x2": {"overhead", "scaling"},
        "2x1": {"allreduce", "compression", "scaling"},
        "2x2": {"allreduce"}, "2x1-jax": {"allreduce"}}


def _positive_durations(rows):
  durations = [v for row in rows for k, v in row.items() if k.endswith("_s")]
  return durations and all(isinstance(v, float) and v > 0 for v in durations)


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory, topo):
  if topo.process_count > 1:
    return None  # never launch jobs from inside an MPI job
  out = tmp_path_factory.mktemp("benchmarks")
  result = launch.python(["-m", "benchmarks", "--quick", "--out", str(out)], timeout=600)
  assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
  with open(out / "results.json", encoding="utf-8") as f:
    return json.load(f), out


@pytest.mark.timeout(660)
def test_quick_run_fills_every_section_of_every_job(quick_results):
  if quick_results is None:
    return  # launched from plain pytest only
  results, _ = quick_results
  assert results["summary"]["failures"] == []
  jobs = {job["job"]: job for job in results["jobs"]}
  assert set(jobs) == set(JOBS)
  for name, sections in JOBS.items():
    for section in sections:
      got = jobs[name]["sections"][section]
      assert got["complete"] and _positive_durations(got["rows"]), (name, section, got)


@pytest.mark.timeout(660)
def test_quick_run_derives_ratios_and_writes_the_report(quick_results):
  if quick_results is None:
    return
  results, out = quick_results
  summary = results["summary"]
  for section in SECTIONS:
    assert summary[section], section
  routes = {(r["job"], r["route"]) for r in summary["allreduce"]}
  # M x N takes the native route where its library is built (install.sh
  # builds it), else the callback route; 2x1 measures both beside mpi4jax.
  from jdist.collectives import native  # pylint: disable=import-outside-toplevel
  built = os.path.exists(native.CPU_LIBRARY)
  expected = {("2x1", "mpi4jax"), ("2x1", "callback"), ("2x1-jax", "local"),
              ("2x2", "native" if built else "callback")}
  if built:
    expected.add(("2x1", "native"))
  assert expected <= routes
  assert all(r["algbw_GBps"] > 0 and (r["variant"] == "mpi" or r["vs_mpi"] > 0)
             for r in summary["allreduce"])
  assert all(r["ratio"] > 0 for r in summary["overhead"])
  fp16 = [r for r in summary["compression"] if r["mode"] == "fp16"]
  assert fp16 and all(r["bytes_ratio"] == pytest.approx(0.5, rel=0.01) for r in fp16)
  assert all(r["samples_per_s"] > 0 for r in summary["scaling"])
  assert any(t["target"].startswith("step overhead") for t in summary["targets"])
  env = results["environment"]
  assert {"jax", "jaxlib", "mpi4py", "mpi4jax", "Open MPI"} <= set(env["versions"])
  assert env["cores"] >= 1 and env["cpu"]
  report = (out / "results.md").read_text()
  for figure in results["figures"]:
    assert (out / f"{figure}.png").stat().st_size > 0
    assert f"({figure}.png)" in report
  assert {"allreduce_bandwidth", "compression", "scaling"} <= set(results["figures"])
  assert "## Targets" in report and "Open MPI" in report


@pytest.mark.timeout(660)
def test_quick_run_has_a_network_section_or_says_why_not(quick_results):
  if quick_results is None:
    return
  results, out = quick_results
  network = results["network"]
  assert network["report"] == "network.md" and (out / "network.md").stat().st_size > 0
  if network["skipped"]:  # no root, iproute2 or torch: the reasons are in the report
    assert all(reason in (out / "network.md").read_text() for reason in network["skipped"])
  if not any(reason.startswith("shaped links skipped") for reason in network["skipped"]):
    with open(out / "network.json", encoding="utf-8") as f:
      rows = json.load(f)["summary"]["rows"]
    assert {"compute", "plain", "fp16", "mpi_f32"} <= {r["variant"] for r in rows}
    assert all(r["step_s"] > 0 for r in rows)


def _reduce_row(variant, time_s, *, replicas, processes, participants, per_call=1):
  return {"variant": variant, "route": "host", "bytes": 16 << 20, "replicas": replicas,
          "processes": processes, "participants": participants, "per_call": per_call,
          "backend": "mpi", "time_s": time_s}


def test_bus_bandwidth_counts_the_ranks_each_all_reduce_spans():
  jobs = [{"job": "2x2", "sections": {"allreduce": {"rows": [
              _reduce_row("mpi", 0.010, replicas=4, processes=2, participants=2),
              _reduce_row("jdist_psum", 0.015, replicas=4, processes=2, participants=4),
              _reduce_row("jdist_noop", 0.005, replicas=4, processes=2, participants=1)]}}},
          {"job": "4x1", "sections": {"allreduce": {"rows": [
              _reduce_row("mpi", 0.030, replicas=4, processes=4, participants=4)]}}}]
  summary = analysis.summarize(jobs)
  rows = {(r["job"], r["variant"]): r for r in summary["allreduce"]}
  # 2 ranks: 1.0 x bytes/time; 4 replicas: 1.5 x bytes/time.
  assert rows[("2x2", "mpi")]["busbw_GBps"] == pytest.approx((16 << 20) / 0.010 / 1e9)
  assert rows[("2x2", "jdist_psum")]["busbw_vs_mpi"] == pytest.approx(1.5 * 0.010 / 0.015)
  assert rows[("2x2", "jdist_psum")]["vs_mpi"] == pytest.approx(1.5)
  # The no-exchange floor: a time beside MPI's, no bus bandwidth, no target.
  noop = rows[("2x2", "jdist_noop")]
  assert noop["busbw_GBps"] is None and noop["vs_mpi"] == pytest.approx(0.5)
  assert noop["algbw_GBps"] == pytest.approx((16 << 20) / 0.005 / 1e9)
  target = next(t for t in summary["targets"] if t["where"] == "2x2 16 MB")
  assert target["bound"] == analysis.MULTI_DEVICE_BANDWIDTH_BOUND and target["met"]
  [pair] = summary["rank_per_replica"]
  assert pair["mpi_job"] == "4x1" and pair["ratio"] == pytest.approx(0.5)
