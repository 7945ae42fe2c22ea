"""The time-to-accuracy benchmark (`python -m benchmarks time_to_accuracy`).

Unit tests of its pure parts: the flax -> torch weight copy (the same logits),
the evaluation schedule and stop decision, the variant selection and the
report's targets; then one end-to-end smoke run on shared memory with the
digits. That one starts its own `mpirun` jobs, so it runs from plain pytest
only (its name has "subprocess": scripts/test.sh leaves it out of the
`mpirun pytest` runs, and it skips itself inside an MPI job).
"""

import json
import os

import jax
import numpy as np
import pytest

from benchmarks import __main__ as entry
from benchmarks.sections import accuracy
from benchmarks.sections import time_to_accuracy
from benchmarks.sections.time_to_accuracy import report as tta_report
from benchmarks.sections.time_to_accuracy import train as train_to_target
from jdist.app import models
from tests import launch


def _torch_or_skip():
  """torch, or a skip naming the torch-peer extra (a failure under CI, which installs it)."""
  missing = time_to_accuracy.torch_missing()
  launch.require([missing] if missing else [], "the torch-peer extra")
  import torch  # pylint: disable=import-outside-toplevel
  return torch


@pytest.mark.parametrize("input_shape", [(28, 28, 1), (8, 8, 1)])
def test_flax_weights_in_torch_give_flax_logits(input_shape):
  # torch is a benchmark-only extra (only the DDP side of
  # benchmarks.sections.time_to_accuracy needs it); .ci/run installs it.
  torch = _torch_or_skip()
  from benchmarks.sections.time_to_accuracy import (  # pylint: disable=g-import-not-at-top
      torch_trainer as torch_accuracy)
  flax_model = models.create_model("cnn", num_classes=10, input_shape=input_shape)
  params, _ = models.init_model(flax_model, jax.random.key(3), input_shape)
  # Nonzero biases, so a misplaced bias would show.
  params = jax.tree.map(lambda p: p + 0.01 * np.arange(p.size).reshape(p.shape) / p.size,
                        params)
  images = np.random.default_rng(0).random((5,) + input_shape, dtype=np.float32)
  expected = np.asarray(flax_model.apply({"params": params}, images))
  net = torch_accuracy.singa_cnn_from_flax(flax_model, params, input_shape)
  with torch.no_grad():
    got = net(torch.from_numpy(torch_accuracy.nchw(images))).numpy()
  np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


class FakeTrainer:
  """Steps that cost nothing and a scripted test accuracy per evaluation."""

  framework = "jdist"

  def __init__(self, accuracies):
    self.accuracies = list(accuracies)
    self.steps = 0
    self.evaluations = 0

  def step(self, indices):
    del indices
    self.steps += 1
    return 1.0 / self.steps

  def sync(self):
    pass

  def evaluate(self):
    self.evaluations += 1
    return self.accuracies.pop(0)

  def wire_bytes(self):
    return 123.0


def _run(trainer, schedule, *, is_root=True, share=lambda value: value):
  ticks = iter(range(10_000))  # each clock reading one second later: a step is 1 s
  batches = lambda epoch: [np.zeros((2, 4), int)] * schedule.steps_per_epoch  # noqa: E731
  rows = list(train_to_target.run_to_target(trainer, schedule, batches, is_root=is_root,
                                            share=share, clock=lambda: float(next(ticks))))
  return rows[:-1], rows[-1]


def test_schedule_evaluates_every_n_steps_and_after_the_last():
  schedule = train_to_target.Schedule(epochs=1, steps_per_epoch=10, eval_every=4, target=0.5)
  assert [s for s in range(1, 11) if schedule.evaluates_after(s)] == [4, 8, 10]
  assert train_to_target.default_eval_every(937) == 234
  assert train_to_target.default_eval_every(3) == 1


def test_run_stops_at_the_first_evaluation_reaching_the_target():
  schedule = train_to_target.Schedule(epochs=2, steps_per_epoch=10, eval_every=4, target=0.5)
  curve, final = _run(FakeTrainer([0.2, 0.4, 0.6, 0.7, 0.8]), schedule)
  assert [(p["step"], p["test_accuracy"]) for p in curve] == [(4, 0.2), (8, 0.4), (12, 0.6)]
  assert curve[-1]["epoch"] == pytest.approx(1.2)
  # The clock reads twice per step and never during an evaluation: 1 s per step.
  assert [p["train_s"] for p in curve] == [4.0, 8.0, 12.0]
  assert final["steps"] == 12 and final["stopped_at_target"]
  assert not final["completed_all_epochs"]
  assert final["reached_step"] == 12 and final["time_to_target_s"] == 12.0
  assert final["epochs_to_target"] == pytest.approx(1.2)
  assert final["median_step_s"] == 1.0 and final["final_accuracy"] == 0.6
  assert final["wire_bytes_per_step"] == 123.0


def test_full_run_keeps_training_past_the_target_and_records_when_it_was_reached():
  schedule = train_to_target.Schedule(epochs=2, steps_per_epoch=10, eval_every=4,
                                      target=0.5, stop_at_target=False)
  curve, final = _run(FakeTrainer([0.2, 0.6, 0.55, 0.7, 0.8]), schedule)
  assert [p["step"] for p in curve] == [4, 8, 12, 16, 20]
  assert final["completed_all_epochs"] and not final["stopped_at_target"]
  assert final["reached_step"] == 8 and final["time_to_target_s"] == 8.0
  assert final["final_accuracy"] == 0.8 and final["epochs_trained"] == 2.0


def test_target_never_reached_gives_none():
  schedule = train_to_target.Schedule(epochs=1, steps_per_epoch=8, eval_every=4, target=0.9)
  _, final = _run(FakeTrainer([0.2, 0.3]), schedule)
  assert final["time_to_target_s"] is None and final["reached_step"] is None
  assert final["completed_all_epochs"] and final["final_accuracy"] == 0.3


def test_only_the_root_evaluates_and_every_rank_takes_its_figure():
  schedule = train_to_target.Schedule(epochs=1, steps_per_epoch=8, eval_every=4, target=0.5)
  trainer = FakeTrainer([])
  shared = []

  def share(value):  # the root's figures, as allgather_object(...)[0] gives them
    shared.append(value)
    return 0.7

  curve, final = _run(trainer, schedule, is_root=False, share=share)
  assert trainer.evaluations == 0 and shared == [None]
  assert [p["test_accuracy"] for p in curve] == [0.7] and final["stopped_at_target"]


def test_variants_are_names_or_name_at_link():
  links = ["1gbit", "100mbit"]
  assert time_to_accuracy.parse_variants("ddp,plain@1gbit,powersgd1", links) == [
      ("ddp", "1gbit"), ("ddp", "100mbit"), ("plain", "1gbit"), ("powersgd1", "1gbit"),
      ("powersgd1", "100mbit")]
  assert time_to_accuracy.parse_variants("", links) == []
  with pytest.raises(ValueError, match="unknown variant"):
    time_to_accuracy.parse_variants("ddp_nope", links)
  with pytest.raises(ValueError, match="not in --links"):
    time_to_accuracy.parse_variants("plain@shm", links)


def test_default_full_goes_with_the_default_variants_only():
  args = entry.parse_args(["time_to_accuracy"])
  assert ("powersgd1", "100mbit") in args.full and ("plain", "1gbit") in args.variants
  assert ("plain", "100mbit") not in args.variants
  args = entry.parse_args(["time_to_accuracy", "--variants", "plain,ddp", "--links", "1gbit"])
  assert args.full == set() and args.target == 0.88 and args.epochs == 4
  quick = entry.parse_args(["time_to_accuracy", "--quick"])
  assert quick.dataset == "digits" and quick.epochs == 1 and quick.links == ["shm", "1gbit"]


def test_skipped_links_and_torch_are_recorded_and_full_variants_train_every_epoch(
    monkeypatch, tmp_path):
  from benchmarks.harness import netns  # pylint: disable=import-outside-toplevel
  shm = netns.link_named("shm")
  monkeypatch.setattr(netns, "available_links",
                      lambda links: ([shm], ["shaped links skipped: not root"]))
  monkeypatch.setattr(time_to_accuracy, "torch_missing", lambda: "torch is not installed")
  monkeypatch.setattr(netns, "remove_stale", lambda: [])
  launched = []

  def fake_run(job, **kwargs):
    del kwargs
    options = dict(job.options)
    launched.append((job.name, options["stop_at_target"], job.prefix))
    run = _run_record("shm", options["variant"], 0.5, 0.9, True)
    return {"wall_s": 1.0,
            "sections": {"time_to_accuracy": {"rows": run["curve"] + [run["final"]]}}}

  monkeypatch.setattr(time_to_accuracy.jobs_lib, "run", fake_run)
  args = entry.parse_args(["time_to_accuracy", "--links", "shm,100mbit", "--variants",
                                      "plain,ddp,powersgd1", "--full", "powersgd1",
                                      "--out", str(tmp_path)])
  results = time_to_accuracy.run_benchmark(args, log=lambda line: None)
  assert results["skipped"] == ["shaped links skipped: not root", "torch is not installed"]
  assert launched == [("plain@shm", True, ()), ("powersgd1@shm", False, ())]
  assert [(r["variant"], r["framework"], r["error"]) for r in results["runs"]] == [
      ("plain", "jdist", None), ("powersgd1", "jdist", None)]
  assert results["summary"]["targets"][0]["note"] == "100mbit was not run"
  time_to_accuracy.write_outputs(results, str(tmp_path))
  assert "**Skipped:** torch is not installed." in (
      tmp_path / "time_to_accuracy.md").read_text()


def _run_record(link, variant, time_to_target, accuracy, completed):
  framework = "torch" if variant.startswith("ddp") else "jdist"
  final = {"kind": "final", "steps": 2800 if completed else 1000, "epochs_trained": 3.0,
           "completed_all_epochs": completed, "time_to_target_s": time_to_target,
           "reached_step": None if time_to_target is None else 900,
           "epochs_to_target": None if time_to_target is None else 0.96,
           "median_step_s": 0.1, "first_step_s": 2.0, "final_accuracy": accuracy,
           "wire_bytes_per_step": None if framework == "torch" else 1000.0,
           "dataset": "fashion_mnist", "train_examples": 60000, "test_examples": 10000,
           "steps_per_epoch": 937, "eval_every": 234}
  curve = [{"kind": "eval", "step": 234, "epoch": 0.25, "train_s": 10.0,
            "test_accuracy": 0.7, "train_loss": 0.9}]
  return {"link": link, "variant": variant, "framework": framework, "curve": curve,
          "final": final, "error": None, "wall_s": 1.0}


def _results(runs):
  env = {"versions": {"jax": "0"}, "cpu": "cpu", "cores": 2, "date": "today",
         "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [1.0, 1.0, 1.0]}
  results = {"command": "python -m benchmarks time_to_accuracy", "environment": env,
             "skipped": ["torch is not installed"], "runs": runs, "wall_s": 60.0,
             "options": {"epochs": 4, "target": 0.88, "batch": 32, "dataset": "auto",
                         "learning_rate": 0.005, "momentum": 0.9}}
  results["summary"] = tta_report.summarize(results)
  return results


def test_targets_use_the_fastest_jdist_mode_and_say_where_plain_comes_from():
  results = _results([
      _run_record("1gbit", "plain", 200.0, 0.890, True),
      _run_record("100mbit", "ddp", 600.0, 0.881, False),
      _run_record("100mbit", "powersgd4", 180.0, 0.886, True),
      _run_record("100mbit", "powersgd1", 150.0, 0.885, True),
      _run_record("100mbit", "topk1%", None, 0.87, True)])
  summary = results["summary"]
  assert summary["fastest_jdist"] == {"1gbit": "plain", "100mbit": "powersgd1"}
  rows = {r["variant"]: r for r in summary["links"]["100mbit"]}
  assert rows["powersgd1"]["vs_ddp"] == pytest.approx(0.25) and rows["ddp"]["vs_ddp"] == 1.0
  assert rows["topk1%"]["vs_ddp"] is None
  time_target, accuracy_target = summary["targets"]
  assert time_target["measured"] == pytest.approx(0.25) and time_target["met"] is True
  assert "powersgd1" in time_target["where"]
  assert accuracy_target["measured"] == pytest.approx(-0.005) and accuracy_target["met"]
  assert "plain 0.8900 (on 1gbit)" in accuracy_target["note"]
  text = tta_report.markdown(results)
  assert "| time to target: fastest jdist mode / DDP plain | 100mbit (powersgd1) |" in text
  assert "| powersgd1 | 150.0 | 900 (0.96) | 100 | 2 | 0.8850 (3.00) | 1000 B | 0.25 |" in text
  assert "| topk1% | not reached |" in text and "| ddp | 600.0 |" in text and "—" in text
  assert "**Skipped:** torch is not installed." in text


def test_targets_are_not_measured_without_their_runs():
  no_plain = _results([_run_record("100mbit", "ddp", 600.0, 0.881, False),
                       _run_record("100mbit", "powersgd1", 150.0, 0.885, True),
                       _run_record("100mbit", "plain", 700.0, 0.880, False)])
  time_target, accuracy_target = no_plain["summary"]["targets"]
  assert time_target["met"] is True
  assert accuracy_target["measured"] is None and accuracy_target["met"] is None
  assert "plain did not train all 4 epochs" in accuracy_target["note"]
  assert "not measured" in tta_report.markdown(no_plain)
  no_link = _results([_run_record("1gbit", "powersgd1", 50.0, 0.885, True)])
  assert all(t["met"] is None and "100mbit was not run" in t["note"]
             for t in no_link["summary"]["targets"])
  no_ddp = _results([_run_record("100mbit", "powersgd1", 150.0, 0.885, True)])
  assert no_ddp["summary"]["targets"][0]["note"] == "DDP plain did not run"


@pytest.mark.timeout(300)
def test_command_runs_end_to_end_in_a_subprocess(tmp_path, topo):
  if topo.process_count > 1:
    pytest.skip("starts its own MPI jobs: runs from plain pytest only")
  variants = "plain" + ("" if time_to_accuracy.torch_missing() else ",ddp")
  result = launch.python(["-m", "benchmarks", "time_to_accuracy", "--links", "shm",
                          "--dataset", "digits", "--epochs", "1", "--target", "0.3",
                          "--variants", variants, "--out", str(tmp_path)], timeout=280)
  assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
  results = json.loads((tmp_path / "time_to_accuracy.json").read_text())
  runs = {run["variant"]: run for run in results["runs"]}
  assert set(runs) == set(variants.split(","))
  for run in runs.values():
    assert run["error"] is None and run["curve"]
    assert all(0 <= p["test_accuracy"] <= 1 and p["train_s"] > 0 for p in run["curve"])
    final = run["final"]
    assert final["time_to_target_s"] > 0 and final["stopped_at_target"]
    assert final["final_accuracy"] >= 0.3 and final["median_step_s"] > 0
  if "ddp" in runs:  # same start, data and SGD: DDP follows jdist plain's curve
    for jdist_point, ddp_point in zip(runs["plain"]["curve"], runs["ddp"]["curve"]):
      assert abs(jdist_point["test_accuracy"] - ddp_point["test_accuracy"]) <= 0.02
  assert "## shm" in (tmp_path / "time_to_accuracy.md").read_text()


# ----------------------------------------------------------------------------
# Issue 28: caps, bounds, DiLoCo / local SGD / post-local SGD variants.


def test_a_capped_run_stops_at_max_seconds_with_an_evaluation_there():
  schedule = train_to_target.Schedule(epochs=2, steps_per_epoch=10, eval_every=4,
                                      target=0.9, max_seconds=6)
  curve, final = _run(FakeTrainer([0.2, 0.3]), schedule)
  assert [(p["step"], p["train_s"], p["test_accuracy"]) for p in curve] == [
      (4, 4.0, 0.2), (6, 6.0, 0.3)]
  assert final["capped"] and final["max_seconds"] == 6 and final["steps"] == 6
  assert final["time_to_target_s"] is None and final["train_s"] == 6.0
  # Reaching the target on the capped step is reaching it, not a cap.
  _, final = _run(FakeTrainer([0.2, 0.95]), schedule)
  assert final["stopped_at_target"] and not final["capped"]


def test_every_rank_stops_at_the_cap_rank_0_decides():
  # This rank's clock is behind rank 0's: it stops where rank 0 reached the
  # cap (step 3 here), not at its own step 6, so both run the same exchanges.
  schedule = train_to_target.Schedule(epochs=2, steps_per_epoch=10, eval_every=4,
                                      target=0.9, max_seconds=6)
  decisions = iter([False, False, True])

  def share(value):  # rank 0's value: its cap decisions, then its accuracy
    return next(decisions) if isinstance(value, bool) else 0.4

  curve, final = _run(FakeTrainer([]), schedule, is_root=False, share=share)
  assert final["capped"] and final["steps"] == 3
  assert [(p["step"], p["test_accuracy"]) for p in curve] == [(3, 0.4)]


def test_caps_are_name_or_name_at_link_equals_seconds():
  links = ["10mbit", "100mbit"]
  assert time_to_accuracy.parse_caps("plain@10mbit=120,ddp=60", links) == {
      ("plain", "10mbit"): 120.0, ("ddp", "10mbit"): 60.0, ("ddp", "100mbit"): 60.0}
  for bad in ("ddp", "ddp=0", "ddp=soon"):
    with pytest.raises(ValueError, match="NAME=SECONDS"):
      time_to_accuracy.parse_caps(bad, links)
  with pytest.raises(ValueError, match="unknown variant"):
    time_to_accuracy.parse_caps("diloco7=5", links)


def _slow_record(link, variant, *, reached=None, train_s=None, step=2816, curve=()):
  """A run that reached the target after `reached` s at `step`, or was capped at `train_s`."""
  final = {"kind": "final", "steps": step if reached else 100, "epochs_trained": 1.0,
           "completed_all_epochs": False, "capped": reached is None,
           "train_s": reached or train_s, "time_to_target_s": reached,
           "reached_step": step if reached else None,
           "epochs_to_target": step / 937 if reached else None, "median_step_s": 2.5,
           "first_step_s": 3.0, "final_accuracy": 0.6, "wire_bytes_per_step": None,
           "dataset": "fashion_mnist", "train_examples": 60000, "test_examples": 10000,
           "steps_per_epoch": 937, "eval_every": 256}
  record = _run_record(link, variant, reached, 0.6, False)
  return dict(record, final=final, curve=[
      {"kind": "eval", "step": s, "epoch": s / 937, "train_s": t, "test_accuracy": a,
       "train_loss": 0.5} for s, t, a in curve] or record["curve"])


def test_slow_targets_bound_a_capped_ddp_plain():
  def runs(ddp_cap):
    return [
        _slow_record("shm", "plain", reached=170.0, curve=[(256, 15.0, 0.79),
                                                           (2816, 170.0, 0.886)]),
        _slow_record("10mbit", "powersgd1", reached=300.0),
        _slow_record("10mbit", "diloco128", reached=150.0, curve=[(256, 14.0, 0.77),
                                                                  (2816, 150.0, 0.881)]),
        _slow_record("10mbit", "diloco32", reached=200.0),
        _slow_record("10mbit", "plain", train_s=120.0),
        _slow_record("10mbit", "ddp", train_s=ddp_cap),
        _slow_record("10mbit", "ddp_powersgd", reached=400.0),
        _slow_record("100mbit", "diloco128", reached=130.0, step=2816)]

  current, ddp, ddp_best, floor, accuracy = _results(runs(120.0))["summary"]["targets"]
  assert current["measured"] == pytest.approx(0.5) and current["met"] is True
  assert "diloco128 / powersgd1" in current["where"]
  # DDP plain capped at 120 s: 150 / 120 bounds the ratio from above, too loosely.
  assert ddp["kind"] == "<=" and ddp["measured"] == pytest.approx(1.25)
  assert ddp["met"] is None and "ddp not reached in 120 s" in ddp["note"]
  assert ddp_best["measured"] == pytest.approx(150 / 400) and ddp_best["met"] is True
  # The floors come from a <mode>_paired run only; a DiLoCo run alone gives none.
  assert floor["measured"] is None and "_paired run" in floor["note"]
  assert accuracy["measured"] == pytest.approx(0.881 - 0.886) and accuracy["met"] is True
  assert "step 2816" in accuracy["note"]
  results = _results(runs(2000.0))
  ddp = results["summary"]["targets"][1]
  assert ddp["kind"] == "<=" and ddp["measured"] == pytest.approx(0.075) and ddp["met"]
  text = tta_report.markdown(results)
  assert "| <= 0.075 | met |" in text
  assert "| ddp | not reached in 2000 s (accuracy 0.6000 at step 100) |" in text
  rows = {r["variant"]: r for r in results["summary"]["links"]["10mbit"]}
  assert (rows["diloco128"]["vs_ddp"], rows["diloco128"]["vs_ddp_kind"]) == (
      pytest.approx(0.075), "<=")


def test_runs_follow_the_links_with_their_caps_and_report_progress(monkeypatch, tmp_path):
  import contextlib  # pylint: disable=import-outside-toplevel
  from benchmarks.harness import netns  # pylint: disable=import-outside-toplevel
  links = [netns.link_named("shm"), netns.link_named("10mbit")]
  monkeypatch.setattr(netns, "available_links", lambda names: (links, []))
  monkeypatch.setattr(netns, "link_namespace", lambda link: contextlib.nullcontext("ns"))
  monkeypatch.setattr(netns, "in_namespace", lambda job, name: job)
  monkeypatch.setattr(netns, "remove_stale", lambda: [])
  launched, progress = [], []
  times = {"diloco32": 200.0, "diloco128": 150.0, "local_sgd32": 100.0}

  def fake_run(job, **kwargs):
    del kwargs
    options = dict(job.options)
    launched.append((job.name, options["max_seconds"]))
    run = _slow_record("shm", options["variant"], reached=times.get(options["variant"]))
    return {"wall_s": 1.0,
            "sections": {"time_to_accuracy": {"rows": run["curve"] + [run["final"]]}}}

  monkeypatch.setattr(time_to_accuracy.jobs_lib, "run", fake_run)
  args = entry.parse_args([
      "time_to_accuracy", "--links", "shm,10mbit", "--variants",
      "diloco32@shm,diloco128@shm,local_sgd32@shm,diloco128@10mbit,plain@10mbit",
      "--max-seconds", "300",
      "--max-seconds-of", "plain=50", "--out", str(tmp_path)])
  results = time_to_accuracy.run_benchmark(args, log=lambda line: None,
                                           progress=progress.append)
  assert launched == [("diloco32@shm", 300.0), ("diloco128@shm", 300.0),
                      ("local_sgd32@shm", 300.0), ("diloco128@10mbit", 300.0),
                      ("plain@10mbit", 50.0)]
  assert {r["framework"] for r in results["runs"]} == {"jdist"}
  assert [len(p["runs"]) for p in progress] == [1, 2, 3, 4, 5]


def test_ddp_post_local_sgd_on_one_rank_trains_like_plain_sgd(monkeypatch):
  # One rank: the warm-up all-reduce and the periodic averaging are identities,
  # so post-local SGD must follow torch.optim.SGD step for step; this checks
  # the hook, the averager and the optimizer are wired (run past the warm-up
  # and two averaging periods) and that sync/evaluate test the averaged model.
  torch = _torch_or_skip()
  import types  # pylint: disable=import-outside-toplevel
  from benchmarks.sections.time_to_accuracy import (  # pylint: disable=g-import-not-at-top
      torch_trainer as torch_accuracy)
  dist = torch.distributed
  if dist.is_initialized():  # another test left one up: under CI that is a bug to fix
    message = "a torch process group is already up in this process"
    if os.environ.get("CI") == "true":
      pytest.fail(message)
    pytest.skip(message)
  shape = (8, 8, 1)
  flax_model = models.create_model("cnn", num_classes=10, input_shape=shape)
  params, _ = models.init_model(flax_model, jax.random.key(0), shape)
  rng = np.random.default_rng(0)
  data = types.SimpleNamespace(
      train_x=rng.random((64,) + shape, dtype=np.float32), train_y=rng.integers(0, 10, 64),
      test_x=rng.random((20,) + shape, dtype=np.float32), test_y=rng.integers(0, 10, 20))
  # A short warm-up and period, so a few steps cover both phases.
  monkeypatch.setitem(accuracy.MODES, torch_accuracy.POST_LOCAL_MODE,
                      {"local_sgd": 2, "local_sgd_warmup": 2})
  steps = 2 + 2 * 2 + 1
  dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
  try:
    trainer = torch_accuracy.TorchTrainer("ddp_postlocal", flax_model, params, data, [0])
    assert trainer.optimizer.averager.period == 2
    reference = torch_accuracy.singa_cnn_from_flax(flax_model, params, shape)
    sgd = torch.optim.SGD(reference.parameters(), lr=accuracy.LEARNING_RATE,
                          momentum=accuracy.MOMENTUM)
    x, y = torch.from_numpy(torch_accuracy.nchw(data.train_x)), torch.from_numpy(
        data.train_y.astype(np.int64))
    for step in range(steps):
      indices = (np.arange(8) + 8 * step) % 64
      loss = trainer.step(indices[None])
      sgd.zero_grad()
      expected = torch.nn.functional.cross_entropy(reference(x[indices]), y[indices])
      expected.backward()
      sgd.step()
      assert loss == pytest.approx(float(expected), rel=1e-5)
    trainer.sync()
    assert trainer.test_net is trainer.average_net
    for got, want in zip(trainer.test_net.parameters(), reference.parameters()):
      np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), atol=1e-5)
    assert 0.0 <= trainer.evaluate() <= 1.0
  finally:
    dist.destroy_process_group()


@pytest.mark.parametrize("mode, local", [("plain", False), ("sdiloco32_bg", True),
                                         ("local_sgd32", True)])
def test_local_update_modes_step_on_their_own_loss(topo, mode, local):
  # DiLoCo and local SGD exchange nothing between syncs: their harness step
  # returns each replica's own loss (no per-step mean across processes);
  # the other modes still return the mean over every replica.
  import types  # pylint: disable=import-outside-toplevel
  from benchmarks.harness import workload  # pylint: disable=import-outside-toplevel
  shape = (8, 8, 1)
  flax_model = models.create_model("cnn", num_classes=10, input_shape=shape)
  params, _ = models.init_model(flax_model, jax.random.key(0), shape)
  rng = np.random.default_rng(0)
  replicas, batch = topo.replica_count, 4
  data = types.SimpleNamespace(
      train_x=rng.random((replicas * batch,) + shape, dtype=np.float32),
      train_y=rng.integers(0, 10, replicas * batch).astype(np.int32))
  trainer = train_to_target.JdistTrainer(mode, flax_model, params, data, topo.replica_indices)
  indices = np.arange(replicas * batch).reshape(replicas, batch)
  losses = [float(workload.loss_and_grads(flax_model, params, data.train_x[rows],
                                          data.train_y[rows])[0]) for rows in indices]
  expected = losses[topo.replica_indices[0]] if local else np.mean(losses)
  assert trainer.step(indices) == pytest.approx(expected, rel=1e-5)
  assert len(set(np.round(losses, 6))) == replicas  # the replicas' losses differ


def test_each_diloco_mode_has_its_own_floor_that_never_syncs():
  for name, options in accuracy.LOCAL_MODES.items():
    if "diloco" not in options or accuracy.never_syncs(name):
      continue
    floor = name + accuracy.NO_SYNC
    assert accuracy.MODES[floor] == dict(options, diloco=accuracy.NEVER)
    assert accuracy.never_syncs(floor) and not accuracy.never_syncs(name)
    assert name in time_to_accuracy.VARIANTS and floor not in time_to_accuracy.VARIANTS
  assert "local_sgd32" + accuracy.NO_SYNC not in accuracy.MODES


class _Steps:
  """A trainer whose steps take `seconds` on a fake clock and log who ran."""

  def __init__(self, name, seconds, log, clock):
    self.name, self.seconds, self.log, self.clock = name, seconds, log, clock

  def step(self, indices):
    del indices
    self.log.append(self.name)
    self.clock.now += self.seconds
    return 0.5


def test_paired_trainer_times_each_program_on_its_own_and_rotates_the_order():
  clock = type("Clock", (), {"now": 0.0, "__call__": lambda self: self.now})()
  log = []
  trainer = train_to_target.PairedTrainer.__new__(train_to_target.PairedTrainer)
  trainer.mode, trainer.clock, trainer.turn = "sdiloco32_int4", clock, 0
  trainer.main = _Steps("main", 0.03, log, clock)
  trainer.floors = {"compute_floor": _Steps("floor", 0.02, log, clock),
                    "sdiloco32_int4_nosync": _Steps("own", 0.025, log, clock)}
  trainer.floor_seconds = {name: [] for name in trainer.floors}
  results = [trainer.step(None) for _ in range(3)]
  assert [r[1] for r in results] == pytest.approx([0.03] * 3)
  assert log == ["main", "floor", "own", "floor", "own", "main", "own", "main", "floor"]
  details = trainer.details()
  assert details["paired_floors"]["compute_floor"] == pytest.approx([0.02, 0.04, 0.06])
  assert details["paired_floors"]["sdiloco32_int4_nosync"] == pytest.approx(
      [0.025, 0.05, 0.075])
  with pytest.raises(ValueError, match="pairs a DiLoCo mode"):
    train_to_target.PairedTrainer("powersgd1_paired", None, None, None, [0])


def test_paired_runs_give_the_floor_rows_of_their_own_job():
  run = _slow_record("100mbit", "sdiloco32_int4_paired", reached=26.0, step=4,
                     curve=[(4, 26.0, 0.89)])
  run["final"].update(paired_mode="sdiloco32_int4", paired_floors={
      "compute_floor": [5.0, 10.0, 15.0, 20.0],
      "sdiloco32_int4_nosync": [6.0, 12.0, 18.0, 25.0]})
  rows = tta_report.floor_targets([run])
  paired = [r for r in rows if "same job" in r["target"]]
  assert [r["measured"] for r in paired] == pytest.approx([26 / 20, 26 / 25])
  assert [r["met"] for r in paired] == [False, True]
  assert "never syncing" in paired[1]["target"] and "at step 4" in paired[1]["note"]
  assert "sdiloco32_int4_paired" in time_to_accuracy.VARIANTS
  assert "powersgd1_paired" not in time_to_accuracy.VARIANTS
