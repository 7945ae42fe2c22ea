"""`jdist train` under injected faults: each ends promptly, with a message and a status.

Every test launches its own job (`tests/jobs/train_faults.py`, which runs
`jdist train` with a fault on rank 1) under mpirun with a hard timeout, so a
hang fails the test instead of blocking CI. Waits use the DEFAULT deadline
(300 s): a test that passes proves the fault ends the job in seconds, not
at the deadline. Named test_fault_*: plain pytest only (scripts/test.sh).
"""

import concurrent.futures
import json
import os
import shutil
import sys
import tempfile

import pytest

import jdist
from tests.jobs import faults

JOB = "tests/jobs/train_faults.py"
JDIST = os.path.join(os.path.dirname(sys.executable), "jdist")
HARD_LIMIT = 240.0  # only a hung job gets near it
PROMPT_S = 90.0  # start-up, a few steps and the fault, on a loaded 2-core machine
# 256 examples, 16 per replica: 8 steps per epoch with 2 replicas, 4 with 4.
TRAIN = ["--model", "mlp", "--dataset", "digits", "--train-limit", "256", "--test-limit", "64",
         "--batch-size", "16", "--no-progress"]


def _train(tmp, processes=2, devices=1, fault=(), flags=()):
  args = [sys.executable, JOB, *fault, "--", *TRAIN, "--cpu-devices", str(devices), *flags]
  return faults.run_args(args, processes=processes, devices=devices, hard_limit=HARD_LIMIT,
                         env={"JDIST_DATA": os.path.join(tmp, "cache")})


def _steps(directory):
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _nan_stop(tmp, devices):
  ckpt = os.path.join(tmp, "ckpt")
  steps_per_epoch = 8 // devices
  result = _train(tmp, devices=devices, fault=["--nan-from", str(steps_per_epoch + 3)],
                  flags=["--epochs", "3", "--checkpoint-dir", ckpt])
  return result, {"steps": _steps(ckpt), "first": steps_per_epoch}


def _records(log):
  if not os.path.exists(log):
    return []
  with open(log, encoding="utf-8") as stream:
    return [json.loads(line) for line in stream]


def _nan_rollback(tmp):
  ckpt, log = os.path.join(tmp, "ckpt"), os.path.join(tmp, "run.jsonl")
  result = _train(tmp, fault=["--nan-at", "11"],
                  flags=["--epochs", "2", "--checkpoint-dir", ckpt, "--on-nonfinite", "rollback",
                         "--log-file", log])
  return result, {"steps": _steps(ckpt), "records": _records(log)}


def _unwritable(tmp):
  blocker = os.path.join(tmp, "a-file")
  with open(blocker, "w", encoding="utf-8") as stream:
    stream.write("not a directory")
  return _train(tmp, flags=["--epochs", "1", "--checkpoint-dir",
                            os.path.join(blocker, "ckpt")]), {}


def _resume_other_world(tmp):
  ckpt, log = os.path.join(tmp, "ckpt"), os.path.join(tmp, "run.jsonl")
  first = _train(tmp, flags=["--epochs", "2", "--max-steps", "5", "--checkpoint-dir", ckpt])
  assert first.returncode == 0, _explain(first)
  refused = _train(tmp, processes=1, flags=["--epochs", "2", "--checkpoint-dir", ckpt,
                                            "--resume"])
  resumed = _train(tmp, processes=1, flags=["--epochs", "2", "--checkpoint-dir", ckpt,
                                            "--resume", "--batch-size", "32", "--log-file", log])
  return refused, {"resumed": resumed, "records": _records(log)}


def _corrupt_latest(tmp):
  ckpt = os.path.join(tmp, "ckpt")
  first = _train(tmp, flags=["--epochs", "2", "--checkpoint-dir", ckpt])
  assert first.returncode == 0, _explain(first)
  for root, _, files in os.walk(os.path.join(ckpt, "16", "state")):
    for name in files:  # every array file of the newest step cut to nothing
      with open(os.path.join(root, name), "wb"):
        pass
  return _train(tmp, flags=["--epochs", "3", "--checkpoint-dir", ckpt, "--resume"]), {
      "entries": sorted(os.listdir(ckpt))}


def _one_epoch(fault, *flags):
  """A job training one epoch with `fault` on rank 1."""
  return lambda tmp: (_train(tmp, fault=fault, flags=["--epochs", "1", *flags]), {})


_JOBS = {
    "nan_stop_2x1": lambda tmp: _nan_stop(tmp, 1),
    "nan_stop_2x2": lambda tmp: _nan_stop(tmp, 2),
    "nan_rollback": _nan_rollback,
    "other_optimizer": _one_epoch(["--rank-args", "--optimizer adam"]),
    "other_train_limit": _one_epoch(["--rank-args", "--train-limit 200"]),
    # The model is built before the settings are compared: building it must not
    # count as a diverged exchange (its exchange is named alike on every rank).
    "other_model": _one_epoch(["--rank-args", "--model cnn"]),
    "other_devices": _one_epoch(["--rank-args", "--cpu-devices 2"]),
    "drift": _one_epoch(["--drift"], "--check-replicas-every", "3"),
    "unwritable": _unwritable,
    "resume_other_world": _resume_other_world,
    "corrupt_latest": _corrupt_latest,
}


def _in_tmp(name):
  tmp = tempfile.mkdtemp(prefix=f"jdist_fault_{name}_")
  try:
    return _JOBS[name](tmp)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def jobs(request):
  """Starts every selected test's job at once, two at a time; maps name to a future."""
  if jdist.get_topology().process_count > 1:
    yield None  # never launch a job from inside an MPI job
    return
  wanted = [item.callspec.params["job"] for item in request.session.items
            if item.module is sys.modules[__name__] and hasattr(item, "callspec")]
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    futures = {name: pool.submit(_in_tmp, name) for name in dict.fromkeys(wanted)}
    yield futures
    for future in futures.values():
      future.cancel()


def _result(jobs, name):
  if jobs is None:
    pytest.skip("fault jobs are launched from plain pytest only")
  result, seen = jobs[name].result()
  faults.report(name, result)
  return result, seen


def _explain(result):
  return (f"exit {result.returncode} after {result.elapsed:.1f} s\nstdout:\n"
          f"{result.stdout[-2500:]}\nstderr:\n{result.stderr[-3500:]}")


def _assert_failed_promptly(result, message):
  assert result.returncode == 1, _explain(result)
  assert message in result.stderr, _explain(result)
  assert result.elapsed < PROMPT_S, _explain(result)
  assert "Traceback" not in result.stderr, _explain(result)


@pytest.mark.parametrize("job", ["nan_stop_2x1", "nan_stop_2x2"])
def test_fault_nan_run_stops_without_saving_over_a_finite_checkpoint(jobs, job):
  result, seen = _result(jobs, job)
  first = seen["first"]
  _assert_failed_promptly(result, "the training state holds NaN or Inf")
  assert (f"nothing was saved over the newest checkpoint, step {first}"
          in result.stderr), _explain(result)
  assert seen["steps"] == [first], seen  # the finite epoch-1 checkpoint, nothing after
  assert "done:" not in result.stdout, _explain(result)


@pytest.mark.parametrize("job", ["nan_rollback"])
def test_fault_nan_spike_rolls_back_to_the_last_checkpoint(jobs, job):
  result, seen = _result(jobs, job)
  assert result.returncode == 0, _explain(result)
  assert "step 13: the training state holds NaN or Inf" in result.stdout, _explain(result)
  assert "rolled back to checkpoint step 8" in result.stdout, _explain(result)
  assert "done: 2 epoch(s)" in result.stdout, _explain(result)
  assert seen["steps"] == [8, 16], seen
  # Steps 14-16 trained on the restored state: finite, and counted alone.
  rollback, epoch = [r for r in seen["records"] if r["event"] in ("rollback", "epoch")][1:3]
  assert rollback == {"event": "rollback", "step": 13, "to_step": 8,
                      "leaf": "params['Dense_0']['kernel']"}, rollback
  assert epoch["rolled_back"] and "nonfinite_loss_steps" not in epoch, epoch
  assert epoch["train_examples"] == 3 * 32 and epoch["train_loss"] < 2.3, epoch


@pytest.mark.parametrize("job, message", [
    # Ranks started differently are stopped at the start.
    ("other_optimizer", "--optimizer: rank 0 'sgd', rank 1 'adam'"),
    ("other_train_limit", "--train-limit: rank 0 256, rank 1 200"),
    ("other_model", "--model: rank 0 'mlp', rank 1 'cnn'"),
    ("other_devices", "different numbers of local devices (rank 0 has 1, rank 1 has 2)"),
    # Replicas drifting apart end the run, naming the leaf.
    ("drift", "replicas diverged by step 3: the first differing leaf is ['params']"),
    # An unwritable checkpoint directory fails before training.
    ("unwritable", "cannot be written"),
])
def test_fault_run_fails_promptly_before_its_first_epoch(jobs, job, message):
  result, _ = _result(jobs, job)
  _assert_failed_promptly(result, message)
  assert "epoch 1/" not in result.stdout, _explain(result)


@pytest.mark.parametrize("job", ["resume_other_world"])
def test_fault_resume_with_another_replica_count_is_exact_or_refused(jobs, job):
  refused, seen = _result(jobs, job)
  _assert_failed_promptly(refused, "written by 2 replicas x batch 16 = 32 examples per step")
  assert "pass --batch-size 32 to keep the global batch of 32" in refused.stderr
  resumed = seen["resumed"]
  assert resumed.returncode == 0, _explain(resumed)
  assert "the same global batch of 32" in resumed.stdout, _explain(resumed)
  epochs = [r for r in seen["records"] if r["event"] == "epoch"]
  # Every example once per epoch (8 steps x 32), the first epoch split across worlds.
  assert [r["train_examples"] for r in epochs] == [256, 256], epochs


@pytest.mark.parametrize("job", ["corrupt_latest"])
def test_fault_corrupt_latest_checkpoint_falls_back_to_an_intact_one(jobs, job):
  result, seen = _result(jobs, job)
  assert result.returncode == 0, _explain(result)
  assert "checkpoint step 16 cannot be read" in result.stdout, _explain(result)
  assert "step 8 (epoch 2, batch 0/8)" in result.stdout, _explain(result)
  assert "16.corrupt" in seen["entries"] and "24" in seen["entries"], seen
