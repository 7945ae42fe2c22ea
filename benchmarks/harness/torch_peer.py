"""The PyTorch peer, DDP (gloo) on SINGA's CNN: `Trainer`s for `network.steps`, or alone one rank
per process (`python -m benchmarks torch_peer --out PREFIX --config JSON`); extra `torch-peer`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from benchmarks.harness import analysis
from benchmarks.harness import outputs
from benchmarks.harness import timing

VARIANTS = ("compute", "ddp", "ddp_fp16", "ddp_powersgd")
LEARNING_RATE = 0.01
POWERSGD_RANK = 1


class SingaCNN(nn.Module):
  """SINGA's MNIST CNN in PyTorch, layer for layer as `jdist.app.models.CNN`."""

  def __init__(self, num_classes: int = 10):
    super().__init__()
    self.features = nn.Sequential(
        nn.Conv2d(1, 20, 5), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(20, 50, 5), nn.ReLU(), nn.MaxPool2d(2, 2))
    self.classifier = nn.Sequential(
        nn.Flatten(), nn.Linear(50 * 4 * 4, 500), nn.ReLU(), nn.Linear(500, num_classes))

  def forward(self, x):
    return self.classifier(self.features(x))


def param_count(model: nn.Module) -> int:
  return sum(p.numel() for p in model.parameters())


def wrap(variant: str, model: nn.Module) -> nn.Module:
  """`model` as `variant` trains it: bare, or DDP with the variant's comm hook."""
  if variant == "compute":
    return model
  if variant == "ddp_powersgd":
    # One bucket: else PowerSGD's chained collectives and the next bucket's race under gloo
    # (about one run in three aborts, torch 2.13.0).
    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
  else:
    ddp = DistributedDataParallel(model)
  if variant == "ddp_fp16":
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
  elif variant == "ddp_powersgd":
    state = powerSGD_hook.PowerSGDState(process_group=None,
                                        matrix_approximation_rank=POWERSGD_RANK,
                                        start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
  elif variant != "ddp":
    raise ValueError(f"Unknown torch variant {variant!r}; choose from {VARIANTS}.")
  return ddp


def init(rank: int, size: int, threads: int | None = None) -> None:
  """Joins the gloo process group once (threads: cores / processes)."""
  torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // size))
  if not dist.is_initialized():
    dist.init_process_group("gloo", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=120))


class Trainer:
  """One variant's model, optimizer and batch; a call runs one SGD step."""

  def __init__(self, variant: str, batch: int, seed: int, rank: int):
    self.threads = torch.get_num_threads()
    torch.manual_seed(seed)  # the same initial weights on every rank and variant
    self.model = wrap(variant, SingaCNN())
    self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE)
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    self.x = torch.rand((batch, 1, 28, 28), generator=generator)
    self.y = torch.randint(0, 10, (batch,), generator=generator)
    self.loss_fn = nn.CrossEntropyLoss()

  def __call__(self) -> float:
    self.optimizer.zero_grad(set_to_none=True)
    loss = self.loss_fn(self.model(self.x), self.y)
    loss.backward()  # DDP: returns once every bucket's all-reduce is done
    self.optimizer.step()
    return float(loss.detach())


def measure(options: dict, rank: int):
  """Yields one row per variant: median step time and spread, seconds."""
  batch = int(options.get("per_process_batch", 64))
  variants = options.get("variants", VARIANTS)
  trainers = {v: Trainer(v, batch, seed=0, rank=rank) for v in variants}
  series = timing.interleaved(trainers, repeats=int(options.get("repeats", 15)),
                              warmup=int(options.get("warmup", 3)), sync=dist.barrier)
  compute = series["compute"].samples if "compute" in series else None
  if compute:  # every rank's compute-only steps, after the timed rounds
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, compute)
    slowest = analysis.slowest_per_round(every)
  for variant in variants:
    row = {"variant": variant, "kind": "torch", "params": param_count(SingaCNN()),
           "per_process_batch": batch, "threads": torch.get_num_threads(),
           **series[variant].as_dict()}
    if compute:
      samples = series[variant].samples
      row["comm_paired_s"] = statistics.median(s - c for s, c in zip(samples, compute))
      row["comm_vs_slowest_s"] = statistics.median(s - c for s, c in zip(samples, slowest))
    yield row


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--out", required=True, help="path prefix of the per-rank JSON files")
  parser.add_argument("--config", required=True, help="JSON: job, options")


def main(args: argparse.Namespace) -> int:
  config = json.loads(args.config)
  options = config.get("options", {})
  rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
  size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
  init(rank, size, int(options.get("threads") or 0) or None)
  recorder = outputs.Recorder(f"{args.out}.rank{rank}.json", {
      "job": config["job"], "topology": f"{size}x1 torch", "rank": rank,
      "backend": f"torch {torch.__version__} gloo", "init_error": None})
  recorder.record("torch", lambda: measure(options, rank))
  dist.barrier()
  dist.destroy_process_group()
  return 0
