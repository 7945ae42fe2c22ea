"""`jdist.app.train.train`: real (tiny) training runs, logs, resume bit for bit.

Every rank runs each test (under mpirun too): `train` is collective. Runs
keep the global batch fixed (64 examples per step whatever the topology) and
use a small slice of sklearn's digits, so each takes a few seconds once its
step function is compiled (compilations are cached across runs in a process).
"""

import json
import os
import shutil
import tempfile

import jax
import numpy as np
import pytest

import jdist
from jdist.checkpoint import layout as checkpoint_layout
from jdist import consistency
from jdist.app import datasets
from jdist.app import train_guard
from jdist.runtime import host
from jdist.app.config import ConfigError
from jdist.app.config import TrainConfig
from jdist.app.cpu_devices import force_cpu_devices
from jdist.app.train import TrainError
from jdist.app.train import train

GLOBAL_BATCH = 64  # about: a whole number of examples per replica


def _global_batch(topo) -> int:
  """The examples per step: GLOBAL_BATCH rounded down to the replica count."""
  return GLOBAL_BATCH // topo.replica_count * topo.replica_count


@pytest.fixture
def shared_dir():
  """A directory every rank sees: rank 0 makes it and removes it afterwards."""
  path = tempfile.mkdtemp(prefix="jdist_train_") if jdist.init().is_primary else None
  path = host.allgather_object(path)[0]
  yield path
  host.barrier()
  if jdist.init().is_primary:
    shutil.rmtree(path, ignore_errors=True)


def _config(topo, **overrides) -> TrainConfig:
  settings = dict(model="mlp", dataset="digits", epochs=2, train_limit=512, test_limit=100,
                  batch_size=_global_batch(topo) // topo.replica_count, lr=0.05, progress=False)
  settings.update(overrides)
  return TrainConfig(**settings)


def _assert_same(a, b):
  flat_a, flat_b = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
  assert len(flat_a) == len(flat_b)
  for (path, x), y in zip(flat_a, flat_b):
    np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


def test_cnn_learns_digits_with_exact_metrics(topo):
  summary = train(_config(topo, model="cnn", train_limit=719, test_limit=None, epochs=2,
                          check_replicas_every=5))
  first, last = summary["epochs"]
  steps_per_epoch = 719 // _global_batch(topo)
  assert last["step"] == summary["steps"] == 2 * steps_per_epoch
  # Training drops the last partial batch; evaluation sees every test example once.
  assert first["train_examples"] == steps_per_epoch * _global_batch(topo)
  assert first["test_examples"] == last["test_examples"] == 360
  assert last["train_loss"] < first["train_loss"]
  assert summary["final_test_accuracy"] > 0.6, summary["final_test_accuracy"]
  assert summary["topology"]["replicas"] == topo.replica_count
  assert last["samples_per_s"] > 0 and last["epoch_time_s"] >= last["train_time_s"]


def test_batchnorm_statistics_stay_identical_on_every_replica(topo):
  # check_replicas_every=1 raises if any replica's params or batch_stats differ.
  summary = train(_config(topo, model="resnet8", epochs=1, train_limit=128, eval_every=0,
                          check_replicas_every=1), return_state=True)
  assert summary["steps"] == 2
  stats = summary["state"]["model_state"]["batch_stats"]
  assert jax.tree.leaves(stats) and all(np.all(np.isfinite(x)) for x in jax.tree.leaves(stats))


def test_json_log_has_one_record_per_epoch_and_a_summary(topo, shared_dir):
  log_file = os.path.join(shared_dir, "logs", "run.jsonl")
  summary = train(_config(topo, epochs=2, log_file=log_file, sparsify="topk:0.1",
                          momentum_correction=True, skip_nonfinite=True,
                          check_replicas_every=1))
  host.barrier()  # rank 0 writes the log; everyone reads it after
  with open(log_file, encoding="utf-8") as stream:
    records = [json.loads(line) for line in stream]
  assert [r["event"] for r in records] == ["epoch", "epoch", "summary"]
  assert [r["epoch"] for r in records[:2]] == [1, 2]
  for record in records[:2]:
    for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy", "epoch_time_s",
                "samples_per_s", "wire_bytes_per_step", "step"):
      assert isinstance(record[key], (int, float)), key
    assert 0 <= record["test_accuracy"] <= 1
    # Bytes cross processes only when there are several of them.
    assert (record["wire_bytes_per_step"] > 0) == topo.multi_process
    assert record["skipped_steps"] == 0
  final = records[-1]
  assert final["epochs"] == records[:2]
  assert final["final_test_accuracy"] == records[1]["test_accuracy"] == summary[
      "final_test_accuracy"]
  assert final["config"]["sparsify"] == "topk:0.1" and final["steps"] == records[1]["step"]


@pytest.mark.parametrize("mode", [{}, {"sparsify": "topk:0.05", "half": "bf16"},
                                  {"partial": 3}], ids=["plain", "topk-bf16", "partial"])
def test_resume_mid_epoch_is_bit_for_bit(topo, shared_dir, mode):
  base = _config(topo, epochs=2, train_limit=256, checkpoint_every=3, check_replicas_every=2,
                 **mode)
  steps_per_epoch = 256 // _global_batch(topo)
  whole = train(_config(topo, **{**base.to_dict(),
                                 "checkpoint_dir": os.path.join(shared_dir, "whole")}),
                return_state=True)
  directory = os.path.join(shared_dir, "interrupted")
  stopped = train(_config(topo, **{**base.to_dict(), "checkpoint_dir": directory,
                                   "max_steps": steps_per_epoch + 2}))
  assert stopped["stopped_early"] and stopped["steps"] == steps_per_epoch + 2
  assert len(stopped["epochs"]) == 1
  resumed = train(_config(topo, **{**base.to_dict(), "checkpoint_dir": directory,
                                   "resume": True}), return_state=True)
  assert resumed["resumed_from_step"] == steps_per_epoch + 2
  assert resumed["steps"] == whole["steps"] == 2 * steps_per_epoch
  _assert_same(whole["state"], resumed["state"])
  # The epoch cut in two reports what the uninterrupted epoch reported.
  assert resumed["epochs"][1]["train_examples"] == whole["epochs"][1]["train_examples"]
  np.testing.assert_allclose(resumed["epochs"][1]["train_loss"], whole["epochs"][1]["train_loss"],
                             rtol=1e-12)
  assert resumed["epochs"][1]["test_accuracy"] == whole["epochs"][1]["test_accuracy"]
  # Already past --max-steps: nothing more to do.
  again = train(_config(topo, **{**base.to_dict(), "checkpoint_dir": directory, "resume": True,
                                 "epochs": 3, "max_steps": 1}))
  assert again["steps"] == whole["steps"] and again["stopped_early"]


def test_resume_after_an_epoch_continues_and_appends_the_log(topo, shared_dir):
  directory, log_file = os.path.join(shared_dir, "ckpt"), os.path.join(shared_dir, "run.jsonl")
  first = train(_config(topo, epochs=1, checkpoint_dir=directory, log_file=log_file))
  second = train(_config(topo, epochs=2, checkpoint_dir=directory, log_file=log_file,
                         resume=True))
  assert second["resumed_from_step"] == first["steps"]
  assert [r["epoch"] for r in second["epochs"]] == [1, 2]
  # Rank 0's record of epoch 1 comes back from the checkpoint (timings are rank 0's).
  for key in ("step", "train_loss", "train_accuracy", "test_loss", "test_accuracy"):
    assert second["epochs"][0][key] == first["epochs"][0][key], key
  host.barrier()
  with open(log_file, encoding="utf-8") as stream:
    events = [json.loads(line)["event"] for line in stream]
  assert events == ["epoch", "summary", "epoch", "summary"]


def test_resume_refuses_a_checkpoint_of_another_run(topo, shared_dir):
  directory = os.path.join(shared_dir, "ckpt")
  train(_config(topo, epochs=1, checkpoint_dir=directory))
  with pytest.raises(TrainError, match=r"already holds checkpoints.*--resume"):
    train(_config(topo, epochs=2, checkpoint_dir=directory))
  # Same shapes (synthetic data is 8x8x1 with 10 classes too): only the settings tell.
  with pytest.raises(TrainError, match=r"--dataset\): checkpoint 'digits', this run 'synthetic'"):
    train(_config(topo, epochs=2, checkpoint_dir=directory, resume=True, dataset="synthetic"))
  with pytest.raises(TrainError, match=r"--model\): checkpoint 'mlp', this run 'cnn'"):
    train(_config(topo, epochs=2, checkpoint_dir=directory, resume=True, model="cnn"))
  with pytest.raises(TrainError, match=r"--seed"):
    train(_config(topo, epochs=2, checkpoint_dir=directory, resume=True, seed=5))


def test_resume_without_a_checkpoint_starts_from_scratch(topo, shared_dir):
  summary = train(_config(topo, epochs=1, checkpoint_dir=os.path.join(shared_dir, "new"),
                          resume=True))
  assert summary["resumed_from_step"] is None and summary["epochs_completed"] == 1


def test_max_steps_and_eval_every(topo):
  stopped = train(_config(topo, epochs=3, max_steps=3))
  assert stopped["steps"] == 3 and stopped["stopped_early"] and stopped["epochs"] == []
  summary = train(_config(topo, epochs=3, eval_every=2))
  assert ["test_accuracy" in r for r in summary["epochs"]] == [False, True, True]
  silent = train(_config(topo, epochs=1, eval_every=0))
  assert "test_accuracy" not in silent["epochs"][0] and silent["final_test_accuracy"] is None


def test_skip_nonfinite_counts_skipped_steps(topo):
  # A learning rate this large overflows the parameters, then every gradient is NaN.
  summary = train(_config(topo, epochs=1, lr=1e38, skip_nonfinite=True))
  assert summary["epochs"][0]["skipped_steps"] > 0


def test_data_errors_are_train_errors_on_every_rank(topo, tmp_path, monkeypatch):
  monkeypatch.setenv("JDIST_DATA", str(tmp_path / "cache"))
  with pytest.raises(TrainError, match="found no complete copy"):
    train(_config(topo, dataset="mnist", data_dir=str(tmp_path), download=False))
  for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
               "t10k-labels-idx1-ubyte"):
    (tmp_path / stem).write_bytes(b"\x00\x00\x08\x03\x00\x00")  # header cut short
  with pytest.raises(TrainError, match="truncated header"):
    train(_config(topo, dataset="mnist", data_dir=str(tmp_path), download=False))
  with pytest.raises(TrainError, match="no full step"):
    train(_config(topo, train_limit=_global_batch(topo) - 1))


def test_bad_config_raises_before_anything_runs():
  with pytest.raises(ConfigError, match=r"batch_size \(--batch-size\)=0"):
    train(TrainConfig(batch_size=0))
  with pytest.raises(ConfigError, match="--partial"):
    train(TrainConfig(partial=2, half="fp16"))


def test_cpu_devices_cannot_change_a_running_backend(topo):
  force_cpu_devices(topo.local_device_count)  # what is running: accepted
  with pytest.raises(ConfigError, match="already running"):
    force_cpu_devices(topo.local_device_count + 1)


def _with_nan_examples(monkeypatch, rows):
  """Makes `train` load digits whose training examples `rows` are NaN."""
  load = datasets.load

  def poisoned(*args, **kwargs):
    data = load(*args, **kwargs)
    train_x = np.array(data.train_x)
    train_x[rows] = np.nan
    return data._replace(train_x=train_x)

  monkeypatch.setattr(datasets, "load", poisoned)


def test_skipped_steps_stay_out_of_the_metrics_and_the_log_is_standard_json(
    topo, shared_dir, monkeypatch):
  _with_nan_examples(monkeypatch, [3, 100, 300])
  log_file = os.path.join(shared_dir, "run.jsonl")
  summary = train(_config(topo, epochs=2, skip_nonfinite=True, log_file=log_file))
  epochs = summary["epochs"]
  for record in epochs:
    assert np.isfinite(record["train_loss"]) and record["nonfinite_loss_steps"] >= 1
    assert record["skipped_steps"] == record["nonfinite_loss_steps"]  # per epoch
    assert record["train_examples"] == (
        (512 // _global_batch(topo) - record["nonfinite_loss_steps"]) * _global_batch(topo))
  assert epochs[1]["skipped_steps_total"] == sum(r["skipped_steps"] for r in epochs)
  host.barrier()

  def refuse(token):
    raise AssertionError(f"non-standard JSON token {token}")

  with open(log_file, encoding="utf-8") as stream:
    records = [json.loads(line, parse_constant=refuse) for line in stream]
  assert records[0]["train_loss"] == epochs[0]["train_loss"]


def test_a_nan_run_stops_before_any_checkpoint_holds_nan(topo, shared_dir, monkeypatch):
  _with_nan_examples(monkeypatch, list(range(512)))  # every step: NaN parameters at once
  directory = os.path.join(shared_dir, "ckpt")
  with pytest.raises(TrainError, match=r"holds NaN or Inf \(first non-finite leaf: "
                     r"params\[.*it was not saved\. Lower --lr"):
    train(_config(topo, epochs=1, checkpoint_dir=directory, eval_every=0))
  host.barrier()
  assert not [name for name in os.listdir(directory) if name.isdigit()]


def test_an_empty_split_is_named(topo, monkeypatch):
  load = datasets.load
  monkeypatch.setattr(datasets, "load",
                      lambda *a, **k: load(*a, **k)._replace(test_x=np.zeros((0, 8, 8, 1)),
                                                             test_y=np.zeros((0,), np.int32)))
  with pytest.raises(TrainError, match="the test split of digits holds no examples"):
    train(_config(topo))


def test_replica_checksums_name_the_first_differing_leaf(topo):
  tree = {"a": np.arange(6, dtype=np.float32), "b": np.ones((2, 3), np.float32)}
  replicated = jdist.replicate(tree)
  assert train_guard.replicas_problem(replicated, step=7) is None
  # The last replica of the job holds a slightly different "b".
  rows = np.stack([tree["b"]] * topo.local_device_count)
  if topo.process_index == topo.process_count - 1:
    rows[-1, 1, 2] += 1e-6
  devices = jax.local_devices()[:topo.local_device_count]
  replicated["b"] = checkpoint_layout.put_local(rows, devices, None)
  problem = train_guard.replicas_problem(replicated, step=7)
  assert problem is not None and "replicas diverged by step 7" in problem, problem
  assert f"first differing leaf is ['b']: replica 0 sum 6, replica {topo.replica_count - 1}" \
      in problem, problem
  assert consistency.check_replicas(replicated)[0].path == "['b']"  # the exact check agrees
