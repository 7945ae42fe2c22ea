"""The `jdist` command: flags, validation, clean error exits, real launches.

The parser tests run in-process (fast, the same on every rank). Tests whose
names contain "subprocess" start their own `jdist` / `mpirun ... jdist` jobs:
run them from plain pytest (`-k "not subprocess"` under mpirun).
"""

import os
import pathlib
import random
import re
import sys

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist.app import cli
from jdist.app.config import TrainConfig
from tests import launch

JDIST = os.path.join(os.path.dirname(sys.executable), "jdist")

# Values for the fuzz test: good ones, and every kind of bad one.
_NUMBERS = ["0", "1", "-1", "3", "32", "0.5", "1e-3", "-0.1", "nan", "inf", "-inf", "1e400",
            "two", "", " ", "0x10", "1_000", "1.5", "--", "-", "9" * 30, "\x00", "Ω"]
_VALUES = {
    "--model": ["cnn", "mlp", "resnet8", "vgg", "", "CNN", "resnet20_gn"],
    "--dataset": ["digits", "mnist", "fashion-mnist", "cifar10", "", "synthetic"],
    "--optimizer": ["sgd", "adam", "adamw", "lamb", ""],
    "--half": ["fp16", "bf16", "fp8", "float16", "", "true"],
    "--sparsify": ["topk:0.01", "topk:0", "topk:1", "topk:1.5", "topk:-1", "topk:", "topk",
                   "threshold:1e-3", "threshold:0", "threshold:-1", "threshold:nan", "random:0.1",
                   ":", ""],
    "--backend": ["auto", "mpi", "jax", "none", "gloo"],
}
_NUMERIC_FLAGS = ["--epochs", "--batch-size", "--eval-batch-size", "--lr", "--momentum",
                  "--weight-decay", "--seed", "--max-steps", "--partial", "--check-replicas-every",
                  "--checkpoint-every", "--eval-every", "--timeout", "--cpu-devices",
                  "--train-limit", "--test-limit"]
_SWITCHES = ["--resume", "--skip-nonfinite", "--no-progress", "--no-download", "--debug",
             "--momentum-correction"]
_PATH_FLAGS = ["--checkpoint-dir", "--log-file", "--data-dir"]
_JUNK = ["--bogus", "-x", "train", "--epochs=", "--lr=0=1", "--batch", "--half", "---epochs",
         "--sparsify", "positional"]


def _random_argv(rng: random.Random) -> list:
  argv = []
  for _ in range(rng.randint(1, 5)):
    kind = rng.random()
    if kind < 0.4:
      argv += [rng.choice(_NUMERIC_FLAGS), rng.choice(_NUMBERS)]
    elif kind < 0.7:
      flag = rng.choice(sorted(_VALUES))
      argv += [flag, rng.choice(_VALUES[flag])]
    elif kind < 0.8:
      argv.append(rng.choice(_SWITCHES))
    elif kind < 0.9:
      argv += [rng.choice(_PATH_FLAGS), "/tmp/jdist-fuzz"]
    else:
      argv.append(rng.choice(_JUNK))
  return argv


@pytest.fixture
def rank0(monkeypatch):
  """Parses as the launcher's rank 0 (under mpirun, only rank 0 prints usage errors)."""
  monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")


def test_usage_errors_are_printed_by_rank_0_only(monkeypatch, capsys):
  for rank, printed in (("0", True), ("1", False)):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", rank)
    with pytest.raises(SystemExit) as stop:
      cli.parse_train_args(["--epochs", "0"])
    assert stop.value.code == cli.EXIT_USAGE  # every rank still exits 2
    assert ("jdist train: error: " in capsys.readouterr().err) == printed


def test_fuzzed_arguments_end_in_a_clean_exit_or_a_valid_config(capsys, rank0):
  rng = random.Random(20240611)
  exits = 0
  for _ in range(400):
    argv = _random_argv(rng)
    try:
      config, _ = cli.parse_train_args(argv)
    except SystemExit as stop:
      exits += 1
      err = capsys.readouterr().err
      assert stop.code == cli.EXIT_USAGE, (argv, stop.code, err)
      lines = err.strip().splitlines()
      assert len(lines) == 1 and lines[0].startswith("jdist train: error: "), (argv, err)
      assert "Traceback" not in err
    else:  # A valid combination: a checked config with the values given.
      assert isinstance(config, TrainConfig) and config.batch_size >= 1 and config.lr > 0, argv
  assert exits >= 200, exits


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "-1"], r"epochs \(--epochs\)=-1 must be an integer >= 1"),
    (["--epochs", "0"], r"--epochs"),
    (["--momentum-correction"], r"--momentum-correction=0.9 only applies with --signsgd or --sparsify"),
    (["--momentum-correction", "--sparsify", "topk:0.01", "--optimizer", "adam"],
     r"needs --optimizer sgd and a --momentum above 0"),
    (["--epochs", "two"], r"argument --epochs: invalid int value: 'two'"),
    (["--batch-size", "0"], r"batch_size \(--batch-size\)=0"),
    (["--lr", "0"], r"lr \(--lr\)=0.0 must be a number in \(0, inf\)"),
    (["--lr", "-0.1"], r"--lr"),
    (["--lr", "nan"], r"--lr"),
    (["--momentum", "1"], r"momentum \(--momentum\)=1.0 must be a number in \[0, 1\)"),
    (["--sparsify", "topk:0"], r"top-k ratio 0 must be in \(0, 1\]"),
    (["--sparsify", "topk:1.5"], r"top-k ratio 1.5 must be in \(0, 1\]"),
    (["--sparsify", "threshold:-1"], r"threshold -1 must be a positive"),
    (["--sparsify", "topk"], r"not understood: use 'topk:RATIO'"),
    (["--model", "vgg"], r"model \(--model\)='vgg' is unknown; choose one of .*cnn"),
    (["--dataset", "cifar10"], r"dataset \(--dataset\)='cifar10' is unknown; choose one of digits"),
    (["--half", "fp8"], r"argument --half: invalid choice: 'fp8'"),
    (["--optimizer", "lamb"], r"argument --optimizer: invalid choice"),
    (["--partial", "4", "--sparsify", "topk:0.01"], r"--partial .* cannot be combined"),
    (["--partial", "2", "--half", "bf16"], r"--partial .* cannot be combined"),
    (["--partial", "0"], r"partial \(--partial\)=0"),
    (["--resume"], r"--resume needs --checkpoint-dir"),
    (["--checkpoint-every", "5"], r"--checkpoint-every needs --checkpoint-dir"),
    (["--timeout", "0"], r"timeout \(--timeout\)=0.0"),
    (["--cpu-devices", "0"], r"cpu_devices \(--cpu-devices\)=0"),
    (["--bogus"], r"unrecognized arguments: --bogus"),
    (["--batch", "8"], r"unrecognized arguments"),  # no abbreviations
])
def test_bad_values_name_the_flag_and_exit_2(capsys, rank0, argv, message):
  with pytest.raises(SystemExit) as stop:
    cli.parse_train_args(argv)
  assert stop.value.code == cli.EXIT_USAGE
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1, err
  assert err.startswith("jdist train: error: ")
  assert re.search(message, err), err


def test_every_flag_reaches_the_config():
  config, debug = cli.parse_train_args([
      "--model", "resnet8", "--dataset", "fashion-mnist", "--data-dir", "/data",
      "--no-download", "--epochs", "7", "--batch-size", "16", "--eval-batch-size", "64",
      "--optimizer", "adam", "--lr", "0.001", "--momentum", "0.8", "--weight-decay", "0.01",
      "--half", "bf16", "--sparsify", "threshold:1e-3", "--seed", "4", "--train-limit", "100",
      "--test-limit", "50", "--checkpoint-dir", "/ck", "--checkpoint-every", "10", "--resume",
      "--max-steps", "99", "--log-file", "run.jsonl", "--eval-every", "2",
      "--check-replicas-every", "5", "--skip-nonfinite", "--timeout", "60", "--backend", "mpi",
      "--no-progress", "--cpu-devices", "2", "--debug"])
  assert debug
  assert config == TrainConfig(
      model="resnet8", dataset="fashion-mnist", data_dir="/data", download=False, epochs=7,
      batch_size=16, eval_batch_size=64, optimizer="adam", lr=0.001, momentum=0.8,
      weight_decay=0.01, half="bf16", sparsify="threshold:1e-3", partial=None,
      skip_nonfinite=True, seed=4, train_limit=100, test_limit=50, checkpoint_dir="/ck",
      checkpoint_every=10, resume=True, max_steps=99, log_file="run.jsonl", eval_every=2,
      check_replicas_every=5, timeout=60.0, backend="mpi", progress=False, cpu_devices=2)
  corrected, _ = cli.parse_train_args(["--sparsify", "topk:0.01", "--momentum-correction"])
  assert corrected.momentum_correction and corrected.sparsify == "topk:0.01"
  defaults, debug = cli.parse_train_args([])
  assert defaults == TrainConfig() and not debug
  assert (defaults.model, defaults.dataset) == ("cnn", "digits")


def test_momentum_correction_moves_the_momentum_into_the_compressor():
  params = {"w": np.zeros((4, 5), np.float32)}
  config, _ = cli.parse_train_args(["--sparsify", "topk:0.1", "--momentum-correction",
                                    "--momentum", "0.8"])
  states = jax.tree.leaves(config.optimizer_spec.build().init(params),
                           is_leaf=lambda x: isinstance(x, jdist.SparsifyState))
  sparsify = [s for s in states if isinstance(s, jdist.SparsifyState)]
  assert len(sparsify) == 1 and sparsify[0].velocity.shape == (20,)
  # Only the compressor keeps a velocity: sgd's own momentum trace is gone.
  assert not any(isinstance(s, optax.TraceState) for s in states)
  plain, _ = cli.parse_train_args(["--sparsify", "topk:0.1", "--momentum", "0.8"])
  states = jax.tree.leaves(plain.optimizer_spec.build().init(params),
                           is_leaf=lambda x: isinstance(x, (jdist.SparsifyState, optax.TraceState)))
  assert any(isinstance(s, optax.TraceState) for s in states)


def test_top_level_command_dispatch(capsys, rank0):
  for argv, code in (([], 2), (["nope"], 2), (["--version"], 0), (["train", "--help"], 0)):
    with pytest.raises(SystemExit) as stop:
      cli.main(argv)
    assert stop.value.code == code, argv
  out = capsys.readouterr()
  assert "--sparsify" in out.out and "jdist 0.1.0" in out.out
  assert "invalid choice: 'nope'" in out.err


def test_train_failures_exit_1_with_one_message(topo, tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("JDIST_DATA", str(tmp_path / "cache"))
  code = cli.main(["train", "--dataset", "mnist", "--data-dir", str(tmp_path), "--no-download",
                   "--no-progress"])
  assert code == cli.EXIT_FAILURE
  err = capsys.readouterr().err
  assert "Traceback" not in err
  if topo.is_primary:  # rank 0 speaks for every rank
    assert err.startswith("jdist train: error: dataset 'mnist': mnist: found no complete copy")
  else:
    assert err == ""


def test_info_prints_versions_and_topology(topo, capsys):
  assert cli.main(["info"]) == 0
  out = capsys.readouterr().out
  if topo.is_primary:
    assert f"jdist {jdist.__version__}" in out and "jax " in out
    assert f"topology: {topo}" in out
    assert sum(line.strip().startswith("process ") for line in out.splitlines()) == (
        topo.process_count)


def test_bench_subprocess_runs_python_m_benchmarks_of_the_checkout(capfd):
  assert cli.main(["bench", "--help"]) == 0  # a subprocess: jdist never imports benchmarks
  assert "python -m benchmarks" in capfd.readouterr().out


def test_bench_outside_a_checkout_says_where_the_benchmarks_are(monkeypatch, capsys):
  monkeypatch.setattr(cli, "benchmarks_checkout", lambda: None)
  assert cli.main(["bench", "--quick"]) == cli.EXIT_FAILURE
  assert "ship with the source checkout" in capsys.readouterr().err


def test_jdist_never_imports_benchmarks():
  package = pathlib.Path(cli.__file__).resolve().parents[1]
  offenders = [str(path) for path in package.rglob("*.py")
               if re.search(r"^\s*(from|import) benchmarks\b", path.read_text(), re.M)]
  assert not offenders


def test_subprocess_bad_flag_is_one_line_and_exit_2():
  done = launch.python([JDIST, "train", "--batch-size", "0"], timeout=120)
  assert done.returncode == 2, done.stderr
  assert done.stderr.strip().splitlines() == [
      "jdist train: error: batch_size (--batch-size)=0 must be an integer >= 1. "
      "(see jdist train --help)"]


def test_subprocess_mpirun_jdist_train_prints_every_epoch(tmp_path):
  log_file = tmp_path / "run.jsonl"
  done = launch.mpirun([JDIST, "train", "--epochs", "2", "--train-limit", "512",
                        "--cpu-devices", "2", "--sparsify", "topk:0.01", "--no-progress",
                        "--log-file", str(log_file)], np=2, timeout=300)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  lines = done.stdout.splitlines()
  assert any("process 0/2 x 2 local devices = 4 replicas" in line for line in lines)
  for epoch in (1, 2):
    assert sum(line.startswith(f"epoch {epoch}/2: train loss") and "test loss" in line
               for line in lines) == 1, done.stdout  # rank 0 only
  assert any(line.startswith("done: 2 epoch(s)") for line in lines)
  assert len(log_file.read_text().splitlines()) == 3
