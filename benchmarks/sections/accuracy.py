"""Test accuracy against compression (a longer, separate run).

    python -m benchmarks accuracy [--epochs 4] [--dataset auto] [--modes ...]

SINGA's CNN, `jdist.dist_opt(optax.sgd(0.005, momentum=0.9))` in each mode on 2 processes;
test accuracy after every epoch, on Fashion-MNIST where installed, else digits (about 27
minutes on 2 cores; `--epochs 1 --limit 6000` is a quick check).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import optax

import jdist
from benchmarks.harness import jobs
from benchmarks.harness import outputs
from benchmarks.harness import report
from benchmarks.harness import workload
from benchmarks.harness.section import Run, section
from benchmarks.harness.section import UsageError
from jdist.app import datasets
from jdist.app import models

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
MODES = {
    "plain": {},
    "fp16": {"half": True},
    "topk1%": {"sparsify": "topk:0.01", "error_feedback": True},
    "topk1%+mc": {"sparsify": "topk:0.01", "momentum_correction": 0.9},
    "partial4": {"partial": 4},
    "powersgd4": {"powersgd": 4},
    "powersgd1": {"powersgd": 1},
}
LOCAL_SGD_WARMUP = 32  # post-local SGD's synchronous steps (PyTorch's start_localSGD_iter)
# Modes that exchange parameters every H steps (`jdist.diloco`, `jdist.local_sgd`): the replicas
# differ between syncs. Used by time_to_accuracy; not in this module's default --modes.
LOCAL_MODES = {
    "diloco8": {"diloco": 8},
    "diloco32": {"diloco": 32},
    "diloco128": {"diloco": 128},
    "sdiloco32": {"diloco": 32, "diloco_fragments": 4},
    "diloco32_int8": {"diloco": 32, "diloco_payload": "int8"},
    "diloco128_int8": {"diloco": 128, "diloco_payload": "int8"},
    # The outer sync in the background: each fragment's exchange lands `diloco_delay` steps on.
    "sdiloco32_bg": {"diloco": 32, "diloco_fragments": 4, "diloco_delay": 8,
                     "diloco_mix": 0.5},
    "diloco128_bg": {"diloco": 128, "diloco_delay": 32, "diloco_mix": 0.5},
    # Streaming DiLoCo with 8-/4-bit pseudo-gradients (exchanged in the sync step).
    "sdiloco32_int8": {"diloco": 32, "diloco_fragments": 4, "diloco_payload": "int8"},
    "sdiloco32_int4": {"diloco": 32, "diloco_fragments": 4, "diloco_payload": "int4"},
    # SparseLoCo: the top 2% (1%, 3%) of each chunk of the pseudo-gradient in 2 bits.
    "diloco16_sparse": {"diloco": 16, "diloco_payload": "sparse"},
    "diloco32_sparse": {"diloco": 32, "diloco_payload": "sparse"},
    "diloco32_sparse1": {"diloco": 32, "diloco_payload": "sparse:0.01"},
    "diloco32_sparse3": {"diloco": 32, "diloco_payload": "sparse:0.03"},
    "diloco8_sparse1": {"diloco": 8, "diloco_payload": "sparse:0.01"},
    # SparseLoCo's own outer step: SGD at lr 1 without momentum (error feedback stands in for it).
    "diloco16_sparse_sgd1": {"diloco": 16, "diloco_payload": "sparse",
                             "diloco_outer": optax.sgd(1.0)},
    "local_sgd8": {"local_sgd": 8, "local_sgd_warmup": LOCAL_SGD_WARMUP},
    "local_sgd32": {"local_sgd": 32, "local_sgd_warmup": LOCAL_SGD_WARMUP},
}
# Each DiLoCo mode's own compute floor: the same step with a sync period longer than any run.
NEVER = 1 << 30  # inner steps
NO_SYNC = "_nosync"
LOCAL_MODES.update({name + NO_SYNC: dict(options, diloco=NEVER)
                    for name, options in list(LOCAL_MODES.items()) if "diloco" in options})
MODES.update(LOCAL_MODES)
# `<mode>_paired` (train_to_target.PairedTrainer): a DiLoCo mode with its floors in the same job.
PAIRED = "_paired"
LEARNING_RATE = 0.005  # SINGA's MNIST example: SGD(lr=0.005, momentum=0.9)
MOMENTUM = 0.9
SEED = 0


def never_syncs(mode: str) -> bool:
  """Whether `mode` is a DiLoCo mode's own compute floor (it exchanges nothing)."""
  return mode.endswith(NO_SYNC) and mode in LOCAL_MODES


def load_data(name: str, limit: int | None):
  """(Dataset, its name): Fashion-MNIST if installed (or asked for), else digits."""
  if name == "auto":
    name = "fashion_mnist" if os.path.isdir(FASHION_MNIST_DIR) else "digits"
  if name == "fashion_mnist":
    data = datasets.load_fashion_mnist(FASHION_MNIST_DIR if os.path.isdir(FASHION_MNIST_DIR)
                                       else None, download=False)
  else:
    data = datasets.load(name, download=False)
  if limit:
    data = data._replace(train_x=data.train_x[:limit], train_y=data.train_y[:limit])
  return data


def build_model(data):
  """SINGA's CNN sized for the data (jdist.app.models), and its initial parameters."""
  shape = data.train_x.shape[1:]
  model = models.create_model("cnn", num_classes=data.num_classes, input_shape=shape)
  params, _ = models.init_model(model, jax.random.key(SEED), shape)
  return model, params


def epoch_batches(num_examples: int, replicas: int, batch: int, epoch: int):
  """Per step, every replica's example indices: the same order on every rank."""
  order = jdist.data.epoch_permutation(num_examples, epoch=epoch, seed=SEED)
  steps = jdist.data.batches_per_epoch(num_examples, batch_size=batch, replica_count=replicas)
  return order[:steps * replicas * batch].reshape(steps, replicas, batch)


def make_evaluate(model, data):
  """Test accuracy of (unreplicated) parameters, computed on the host of each rank."""

  @jax.jit
  def correct(params, x, y):
    return models.correct_count(model.apply({"params": params}, x), y)

  def evaluate(params) -> float:
    hits = sum(int(correct(params, data.test_x[i:i + 1000], data.test_y[i:i + 1000]))
               for i in range(0, len(data.test_y), 1000))
    return hits / len(data.test_y)

  return evaluate


def mode_transformation(mode: str) -> optax.GradientTransformation:
  """`jdist.dist_opt(optax.sgd(...), **MODES[mode])`."""
  corrected = "momentum_correction" in MODES[mode]
  inner = optax.sgd(LEARNING_RATE, momentum=None if corrected else MOMENTUM)
  return jdist.dist_opt(inner, **MODES[mode])


def train_mode(ctx, mode: str, data, model, params, evaluate, epochs: int, batch: int):
  """Yields one row per epoch of training in `mode`."""
  topo = ctx.topo
  tx = mode_transformation(mode)
  step = workload.jdist_step(model, tx)
  replicated = jdist.replicate(params)
  opt_state = jdist.data_parallel(tx.init)(replicated)
  mine = list(topo.replica_indices)
  for epoch in range(epochs):
    start = time.perf_counter()
    losses = []
    for indices in epoch_batches(len(data.train_y), topo.replica_count, batch, epoch):
      rows = indices[mine]  # [local devices, batch]
      replicated, opt_state, loss = step(replicated, opt_state,
                                         workload.shard(data.train_x[rows]),
                                         workload.shard(data.train_y[rows]))
      losses.append(loss)
    synced = jdist.sync_params(replicated) if "partial" in MODES[mode] else replicated
    accuracy = evaluate(jdist.unreplicate(synced))
    yield {"mode": mode, "epoch": epoch + 1, "test_accuracy": accuracy,
           "train_loss": float(sum(float(l[0]) for l in losses[-50:]) / min(50, len(losses))),
           "steps": len(losses), "wire_bytes_per_step": float(
               jdist.wire_bytes(jdist.unreplicate(opt_state))),
           "epoch_s": time.perf_counter() - start}


NAME = "accuracy"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  """The section: every mode in turn, a row per epoch."""
  options = ctx.options
  data = load_data(options.get("dataset", "auto"), options.get("limit"))
  model, params = build_model(data)
  evaluate = make_evaluate(model, data)
  for mode in options.get("modes", list(MODES)):
    for row in train_mode(ctx, mode, data, model, params, evaluate,
                          int(options.get("epochs", 4)), int(options.get("batch", 32))):
      yield dict(row, dataset=data.name, train_examples=len(data.train_y),
                 test_examples=len(data.test_y), batch_per_replica=options.get("batch", 32),
                 replicas=ctx.topo.replica_count)


def markdown(results: dict) -> str:
  rows = results["rows"]
  lines = report.header("jdist: accuracy against compression", results, minutes=True)
  if rows:
    first = rows[0]
    lines += [f"SINGA's CNN, {first['dataset']} ({first['train_examples']:,} train / "
              f"{first['test_examples']:,} test images), {first['replicas']} replicas x "
              f"batch {first['batch_per_replica']}, `dist_opt(optax.sgd({LEARNING_RATE}, "
              f"momentum={MOMENTUM}), ...)`, same initial parameters and data order "
              f"(`topk1%+mc`: `optax.sgd({LEARNING_RATE})` with `momentum_correction="
              f"{MOMENTUM}`, the momentum moved before the selection).", ""]
  lines += report.table(
      ["mode", "epoch", "test accuracy", "train loss (last 50 steps)", "sent per step",
       "epoch s"],
      [[r["mode"], r["epoch"], f"{r['test_accuracy']:.4f}", f"{r['train_loss']:.4f}",
        report.size(r["wire_bytes_per_step"]), f"{r['epoch_s']:.0f}"] for r in rows])
  lines += report.failures([("the run ended early", results["error"])] if results.get("error")
                           else [])
  return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--epochs", type=int, default=4)
  parser.add_argument("--dataset", default="auto", choices=("auto", "fashion_mnist", "digits"))
  parser.add_argument("--modes", default=",".join(m for m in MODES if m not in LOCAL_MODES),
                      help="from " + ", ".join(MODES).replace("%", "%%"))
  parser.add_argument("--batch", type=int, default=32, help="examples per replica per step")
  parser.add_argument("--limit", type=int, help="use only the first N training examples")
  parser.add_argument("--timeout", type=float, default=3600, help="seconds before the job "
                      "is killed")


def check(args: argparse.Namespace) -> None:
  if set(args.modes.split(",")) - set(MODES) or args.epochs < 1 or args.batch < 1:
    raise UsageError(f"--modes must be from {list(MODES)}; --epochs and --batch must be >= 1.")


def main(args: argparse.Namespace) -> int:
  modes = tuple(args.modes.split(","))
  options = {"epochs": args.epochs, "dataset": args.dataset, "modes": modes,
             "batch": args.batch, "limit": args.limit}
  job = jobs.Job("accuracy-2x1", 2, 1, (sys.modules[__name__],), options=tuple(options.items()))
  start, environment = time.perf_counter(), report.environment()
  result = jobs.run(job, quick=False, timeout=args.timeout)
  section = result.get("sections", {}).get("accuracy", {})
  results = report.results(args.command, environment, start, options=options,
                           rows=section.get("rows", []),
                           error=result.get("error") or section.get("error"))
  outputs.write_report(args.out, results, markdown, json_name="accuracy.json",
                       md_name="accuracy.md")
  print(markdown(results))
  return 1 if results["error"] else 0


SECTION = section("accuracy", "test accuracy against compression, 2 processes",
                  host=Run.of(sys.modules[__name__], report=markdown, out="docs/benchmarks"))
