"""A small transformer language model: DiLoCo against plain at equal tokens, on shaped links.

    python -m benchmarks lm_diloco [--links 10mbit,100mbit] [--variants plain,diloco32,...]
        [--tokens N] [--eval-every 64] [--target-at 0.5] [--max-seconds-of NAME[@LINK]=S]

Each (link, variant) is one 2x1 job training `workload`'s miniGPT for `--tokens` tokens;
lm_diloco.json and .md are rewritten after every run (docs/diloco.md, the language model).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from benchmarks.harness import jobs as jobs_lib
from benchmarks.harness import netns
from benchmarks.harness import outputs
from benchmarks.harness import report
from benchmarks.harness.section import UsageError
from benchmarks.sections.lm_diloco import report as lm_diloco_report
from benchmarks.sections.lm_diloco import train as lm_train
from benchmarks.sections.time_to_accuracy import run as time_to_accuracy

DEFAULTS = dict(lm_train.DEFAULTS, links="10mbit,100mbit",
                variants="plain,powersgd1,diloco32,diloco128,diloco128_int8,local_sgd32")
QUICK = dict(DEFAULTS, links="shm", variants="plain,diloco8", tokens=64 * 2 * 4 * 32, batch=4,
             seq=32, embed=32, blocks=1, stories=400, validation_stories=40, eval_every=16)
SIZES = ("tokens", "batch", "seq", "embed", "blocks", "lr", "stories", "validation_stories",
         "eval_every")
JOB_TIMEOUT = 900  # seconds per job


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None] = print,
                  progress: Callable[[dict], None] | None = None) -> dict[str, Any]:
  """Runs every (link, variant) job of `args`; returns the results, summary included."""
  start, environment = time.perf_counter(), report.environment()
  options = {key: getattr(args, key) for key in SIZES}

  def results_of(runs: list[dict], skipped: list[str], plan: list) -> dict[str, Any]:
    del plan  # every run is in `runs`
    results = report.results(
        args.command, environment, start, skipped=skipped, runs=list(runs),
        options=dict(options, target_at=args.target_at, max_seconds=args.max_seconds,
                     caps={f"{v}@{l}": c for (v, l), c in args.caps.items()}))
    results["summary"] = lm_diloco_report.summarize(results)
    return results

  def job_for(link: netns.Link, variant: str) -> jobs_lib.Job:
    cap = args.caps.get((variant, link.name), args.max_seconds)
    return jobs_lib.Job(f"{variant}@{link.name}", 2, 1, (lm_train,), options=tuple(
        dict(options, variant=variant, max_seconds=cap).items()))

  return time_to_accuracy.run_plan(args, lm_train, job_for, results_of, log=log,
                                   progress=progress)


def write_outputs(results: dict, out_dir: str) -> list[str]:
  """lm_diloco.json and lm_diloco.md into `out_dir`; returns the files written."""
  return outputs.write_report(out_dir, results, lm_diloco_report.markdown,
                              json_name="lm_diloco.json", md_name="lm_diloco.md")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The section's options; `--quick` (the settings of `QUICK`) and `--out` are common."""
  time_to_accuracy.add_plan_arguments(parser, DEFAULTS, lm_train.VARIANTS, "lm_diloco.json",
                                      JOB_TIMEOUT)
  for key, kind, text in (
      ("tokens", int, "tokens trained, all replicas together"),
      ("batch", int, "windows per replica per step"), ("seq", int, "tokens per window"),
      ("embed", int, "embedding width (feed-forward: 4x)"), ("blocks", int, "transformer blocks"),
      ("lr", float, "AdamW's learning rate (the inner one of DiLoCo and local SGD)"),
      ("stories", int, "training stories generated"),
      ("validation_stories", int, "held-out stories generated"),
      ("eval_every", int, "steps between two validation losses")):
    parser.add_argument(f"--{key.replace('_', '-')}", type=kind,
                        help=f"{text} (default {DEFAULTS[key]}; --quick {QUICK[key]})")
  parser.add_argument("--target-at", type=float, default=0.5,
                      help="the loss target is plain's validation loss after this fraction "
                      "of the tokens (default 0.5)")


def check(args: argparse.Namespace) -> None:
  """Fills the defaults (of --quick or the full run) and parses the variant lists."""
  time_to_accuracy.parse_plan(args, QUICK if args.quick else DEFAULTS, lm_train.VARIANTS)
  if (min(args.tokens, args.batch, args.seq, args.embed, args.blocks, args.stories,
          args.validation_stories) < 1 or args.eval_every < 0 or args.lr <= 0
      or not 0 < args.target_at <= 1 or args.max_seconds < 0):
    raise UsageError("--tokens, --batch, --seq, --embed, --blocks and the story "
                     "counts must be >= 1, --eval-every >= 0 (0: at the end only), "
                     "--lr > 0, --target-at in (0, 1], --max-seconds >= 0.")


def main(args: argparse.Namespace) -> int:
  done = outputs.measure_or_render(args, lambda progress: run_benchmark(args, progress=progress),
                                   lm_diloco_report.summarize, write_outputs)
  if done is None:
    return 0
  results, written = done
  target = results["summary"]["target"]
  print(f"target: validation loss {target['loss']} (plain's after {target['tokens']} tokens)")
  for row in (r for rows in results["summary"]["links"].values() for r in rows):
    print(f"{row['variant']}@{row['link']}: validation loss {row['val_loss']} after "
          f"{row['tokens']} tokens in {row['train_s']} s; time to target "
          f"{row['time_to_target_s']} ({row['target_kind']})")
  for run in (r for r in results["runs"] if r["error"]):
    print(f"{run['variant']}@{run['link']}: FAILED: {run['error'].splitlines()[0][:200]}")
  print(f"Wrote {', '.join(written)} into {args.out} in {results['wall_s']:.0f} s.")
  return 1 if any(run["error"] for run in results["runs"]) else 0
