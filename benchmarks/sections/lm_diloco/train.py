"""Worker measurement "lm_diloco": one variant of the language model trained for a number of
tokens (`run_to_target` with no target, the validation loss in place of the accuracy)."""

from __future__ import annotations

from typing import Any

import jax
import optax

import jdist
from benchmarks.harness import workload
from benchmarks.sections import accuracy
from benchmarks.sections.lm_diloco import workload as lm_workload
from benchmarks.sections.time_to_accuracy import train as train_to_target
from jdist.runtime import host

# Every mode of benchmarks.sections.accuracy but DGC's momentum correction (SGD's momentum).
VARIANTS = tuple(m for m in accuracy.MODES if "momentum_correction" not in accuracy.MODES[m])
DEFAULTS = {"tokens": 2 ** 20, "batch": 16, "seq": 64, "embed": 64, "blocks": 2, "lr": 1e-3,
            "stories": 8000, "validation_stories": 300, "eval_every": 64}

# run_to_target's fields about a test accuracy and its target, which this section has not.
TARGET_FIELDS = ("test_accuracy", "final_accuracy", "epoch", "epochs_trained",
                 "completed_all_epochs", "stopped_at_target", "reached_step", "epochs_to_target",
                 "time_to_target_s")


def transformation(variant: str, lr: float) -> optax.GradientTransformation:
  """`jdist.dist_opt(optax.adamw(lr), **accuracy.MODES[variant])`."""
  if variant not in VARIANTS:
    raise ValueError(f"Unknown variant {variant!r}: choose from {list(VARIANTS)}.")
  return jdist.dist_opt(optax.adamw(lr), **accuracy.MODES[variant])


def steps_for(tokens: int, replicas: int, batch: int, seq: int) -> int:
  """Steps that train on `tokens` tokens (at least one): each step takes replicas x batch x seq."""
  return max(1, tokens // (replicas * batch * seq))


class LanguageModelTrainer(train_to_target.JdistTrainer):
  """A jdist mode's run on the language model: `step(indices)` trains on windows."""

  def __init__(self, variant: str, model, params: Any, corpus: lm_workload.Corpus, replicas,
               lr: float):  # pylint: disable=super-init-not-called
    tx = transformation(variant, lr)
    self.start(variant, tx, lm_workload.train_step(model, tx), params, replicas)
    self.corpus = corpus
    self.validate = lm_workload.make_validate(model, corpus.validation)

  def inputs(self, rows) -> tuple:
    return (workload.shard(self.corpus.train[rows]),)

  def evaluate(self) -> float:
    return self.validate(self.test_params)

  def warm_up(self, indices) -> None:
    """Compiles the step: one step on `indices` whose results are dropped (no step counted)."""
    jax.block_until_ready(self.train_step(self.params, self.opt_state,
                                          *self.inputs(indices[self.replicas])))


def batches(corpus: lm_workload.Corpus, replicas: int, batch: int, steps: int):
  """Every step's window indices `[replicas, batch]`, over as many epochs as it takes."""
  epoch = 0
  while steps > 0:
    order = accuracy.epoch_batches(len(corpus.train), replicas, batch, epoch)[:steps]
    yield from order
    steps -= len(order)
    epoch += 1


NAME = "lm_diloco"  # the job results' key (benchmarks.harness.worker)


def run(ctx):
  """The section: the variant of `ctx.options` trained for its tokens, row by row."""
  options = dict(DEFAULTS, **ctx.options)
  variant = options["variant"]
  batch, seq = int(options["batch"]), int(options["seq"])
  corpus = lm_workload.load_corpus(int(options["stories"]), int(options["validation_stories"]),
                                   seq)
  model, params = lm_workload.build_model(corpus, seq, int(options["embed"]),
                                          int(options["blocks"]))
  replicas = ctx.topo.replica_count
  steps = steps_for(int(options["tokens"]), replicas, batch, seq)
  tokens_per_step = replicas * batch * seq
  schedule = train_to_target.Schedule(
      epochs=1, steps_per_epoch=steps, eval_every=int(options["eval_every"]) or steps,
      target=float("inf"), stop_at_target=False,
      max_seconds=float(options.get("max_seconds") or 0.0))
  trainer = LanguageModelTrainer(variant, model, params, corpus, ctx.topo.replica_indices,
                                 float(options["lr"]))
  trainer.warm_up(next(batches(corpus, replicas, batch, 1)))
  ctx.sync()
  rows = train_to_target.run_to_target(
      trainer, schedule, lambda _: batches(corpus, replicas, batch, steps),
      is_root=ctx.rank == 0,
      share=lambda value: host.allgather_object(value, "lm_diloco validation loss")[0])
  for point in rows:  # run_to_target keeps its curve's rows: copies are changed here
    row = {k: v for k, v in point.items() if k not in TARGET_FIELDS}
    row.update(variant=variant, val_loss=point.get("test_accuracy", point.get("final_accuracy")),
               tokens=point.get("step", point.get("steps")) * tokens_per_step)
    if row["kind"] == "final":
      row.update(steps_planned=steps, tokens_per_step=tokens_per_step, replicas=replicas,
                 batch_per_replica=batch, seq=seq, embed=int(options["embed"]),
                 blocks=int(options["blocks"]), lr=float(options["lr"]),
                 parameters=sum(int(p.size) for p in jax.tree.leaves(params)),
                 train_windows=len(corpus.train), validation_windows=len(corpus.validation),
                 train_tokens=corpus.train_tokens, eval_every=schedule.eval_every)
    yield row
