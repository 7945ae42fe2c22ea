"""A small transformer language model: DiLoCo against plain at equal tokens, on shaped links.

    python -m benchmarks lm_diloco [--links 10mbit,100mbit] [--variants plain,diloco32,...]
        [--tokens N] [--eval-every 64] [--target-at 0.5] [--max-seconds-of NAME[@LINK]=S]

One 2x1 job per (link, variant) (docs/diloco.md, the language model).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from benchmarks.harness import jobs as jobs_lib
from benchmarks.harness import netns
from benchmarks.harness import outputs
from benchmarks.harness import report
from benchmarks.harness.section import Run, UsageError, section
from benchmarks.sections import time_to_accuracy
from benchmarks.sections.lm_diloco import train as lm_train
from benchmarks.sections.time_to_accuracy import report as time_to_accuracy_report

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
    results["summary"] = summarize(results)
    return results

  def job_for(link: netns.Link, variant: str) -> jobs_lib.Job:
    cap = args.caps.get((variant, link.name), args.max_seconds)
    return jobs_lib.Job(f"{variant}@{link.name}", 2, 1, (lm_train,), options=tuple(
        dict(options, variant=variant, max_seconds=cap).items()))

  return time_to_accuracy.run_plan(args, lm_train, job_for, results_of, log=log,
                                   progress=progress)


def write_outputs(results: dict, out_dir: str) -> list[str]:
  """lm_diloco.json and lm_diloco.md into `out_dir`; returns the files written."""
  return outputs.write_report(out_dir, results, markdown,
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
  done = outputs.measure_or_render(args, lambda each: run_benchmark(args, progress=each),
                                   summarize, write_outputs)
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


REFERENCE = "plain"


def _planned_tokens(runs: list[dict]) -> int | None:
  return next((r["final"]["steps_planned"] * r["final"]["tokens_per_step"]
               for r in runs if r.get("final")), None)


def _complete(run: dict) -> bool:
  final = run.get("final") or {}
  return bool(final) and final["steps"] == final["steps_planned"]


def loss_target(runs: list[dict], target_at: float) -> dict[str, Any]:
  """`{"loss", "tokens", "step", "from"}`: plain's validation loss at `target_at` of the tokens
  (all None when no plain run got there).
  """
  planned = _planned_tokens(runs)
  if planned is None:
    return {"loss": None, "tokens": None, "step": None, "from": None}
  plains = sorted((r for r in runs if r["variant"] == REFERENCE and r.get("curve")),
                  key=lambda r: not _complete(r))
  for run in plains:
    point = next((p for p in run["curve"] if p["tokens"] >= target_at * planned), None)
    if point is not None:
      return {"loss": point["val_loss"], "tokens": point["tokens"], "step": point["step"],
              "from": f"{REFERENCE}@{run['link']}"}
  return {"loss": None, "tokens": None, "step": None, "from": None}


def time_to(run: dict, loss: float | None) -> tuple[float | None, int | None]:
  """Training seconds and tokens at the run's first evaluation at or below `loss`."""
  point = next((p for p in run.get("curve", []) if loss is not None and p["val_loss"] <= loss),
               None)
  return (point["train_s"], point["tokens"]) if point else (None, None)


def link_rows(runs: list[dict], link: str, target: float | None,
              plain_loss: float | None) -> list[dict]:
  """One row per variant run on `link` (see the module docstring)."""
  rows = []
  for run in (r for r in runs if r["link"] == link):
    final = run.get("final") or {}
    seconds, tokens = time_to(run, target)
    row = {"variant": run["variant"], "link": link, "failed": not final,
           "val_loss": final.get("val_loss"), "tokens": final.get("tokens"),
           "capped": final.get("capped"), "train_s": final.get("train_s"),
           "median_step_s": final.get("median_step_s"),
           "first_step_s": final.get("first_step_s"),
           "wire_bytes_per_step": final.get("wire_bytes_per_step"),
           "time_to_target_s": seconds, "tokens_to_target": tokens,
           "loss_vs_plain": (final["val_loss"] - plain_loss
                             if _complete(run) and plain_loss is not None else None)}
    row["target_kind"] = ("=" if seconds is not None else ">=" if final else "")
    rows.append(row)
  plain = next((r for r in rows if r["variant"] == REFERENCE), None)
  for row in rows:
    row["vs_plain"], row["vs_plain_kind"] = (
        time_to_accuracy_report.bounded_ratio(row, plain) if plain and not row["failed"]
        else (None, ""))
  return rows


def summarize(results: dict) -> dict[str, Any]:
  runs = results["runs"]
  target = loss_target(runs, results["options"]["target_at"])
  plain = next((r for r in runs if r["variant"] == REFERENCE and _complete(r)), None)
  plain_loss = plain["final"]["val_loss"] if plain else None
  links = list(dict.fromkeys(r["link"] for r in runs))
  return {"target": target, "plain_loss": plain_loss,
          "plain_loss_from": plain and f"{REFERENCE}@{plain['link']}",
          "links": {link: link_rows(runs, link, target["loss"], plain_loss) for link in links}}


def _loss(value: float | None) -> str:
  return "-" if value is None else f"{value:.4f}"


def _to_target(row: dict) -> str:
  if row["time_to_target_s"] is not None:
    return f"{row['time_to_target_s']:.1f} ({row['tokens_to_target'] / 1e6:.2f} M tokens)"
  if row["train_s"] is None:
    return "-"
  return f">= {row['train_s']:.1f} (not reached{', capped' if row['capped'] else ''})"


def _link_table(rows: list[dict]) -> list[str]:
  body = []
  for r in rows:
    if r["failed"]:
      body.append([r["variant"], "failed"] + ["-"] * 7)
      continue
    wire = r["wire_bytes_per_step"]
    body.append([
        r["variant"], f"{_loss(r['val_loss'])} ({r['tokens'] / 1e6:.2f} M"
        f"{', capped' if r['capped'] else ''})",
        "-" if r["loss_vs_plain"] is None else f"{r['loss_vs_plain']:+.4f}",
        f"{r['train_s']:.1f}", report.ms(r["median_step_s"]), report.num(r["first_step_s"]),
        "-" if wire is None else report.size(wire), _to_target(r),
        time_to_accuracy_report.show_ratio(r["vs_plain"], r["vs_plain_kind"])])
  return report.table(["variant", "validation loss (tokens)", "- plain's at equal tokens",
                       "training s", "median step ms", "first step s", "sent per step",
                       "s to target (tokens)", "time to target / plain's"], body)


def _header(results: dict) -> list[str]:
  options = results["options"]
  first = next((r["final"] for r in results["runs"] if r.get("final")), None)
  sizes = (f"{first['parameters']:,} parameters ({first['blocks']} blocks, embed "
           f"{first['embed']}, 4 heads, seq {first['seq']}); {first['train_tokens']:,} training "
           f"tokens in {first['train_windows']:,} windows, {first['validation_windows']} "
           f"held-out windows; {first['replicas']} replicas x {first['batch_per_replica']} "
           f"windows x {first['seq']} tokens = {first['tokens_per_step']:,} tokens per step, "
           f"{first['steps_planned']} steps, validation every {first['eval_every']} steps"
           if first else "no run finished")
  caps = ", ".join(f"{k} {v:g} s" for k, v in options.get("caps", {}).items())
  return report.header(
      "jdist: a small language model, DiLoCo against plain at equal tokens", results,
      f"examples/minigpt_single.py's miniGPT on its generated stories: {sizes}.",
      f"2 processes x 1 device, one job per link and variant; plain: "
      f"`dist_opt(optax.adamw({options['lr']}))`; validation loss in nats per token on "
      "held-out windows; training seconds exclude evaluations and compilation. The "
      "modes and the method: docs/diloco.md (language model).",
      f"Caps (training seconds): {options.get('max_seconds') or 'none'} each"
      f"{'; ' + caps if caps else ''}; a capped run's seconds are a lower bound on its time "
      "to the target.", minutes=True)


def markdown(results: dict) -> str:
  """lm_diloco.md from the results (summary included)."""
  summary = results["summary"]
  target = summary["target"]
  lines = _header(results) + ["## Target", "",
            (f"Validation loss {target['loss']:.4f}: {target['from']} after "
             f"{target['tokens']:,} tokens (step {target['step']}, "
             f"{results['options']['target_at']:g} of the tokens). Plain's loss after every "
             f"token: {_loss(summary['plain_loss'])} ({summary['plain_loss_from']})."
             if target["loss"] is not None else "No plain run reached the target's tokens: "
             "no target."), ""]
  for link, rows in summary["links"].items():
    lines += [f"## {link}", ""] + _link_table(rows)
    lines += ["Validation loss (training seconds) at each evaluation:", ""]
    lines += report.curve_table([r for r in results["runs"] if r["link"] == link],
                                ("M tokens", lambda p: f"{p['tokens'] / 1e6:.3f}"),
                                lambda p: f"{p['val_loss']:.4f} ({p['train_s']:.0f} s)")
  return "\n".join(lines + time_to_accuracy_report.failures(results["runs"])) + "\n"


SECTION = section(
    "lm_diloco", "a small transformer language model: validation loss at equal tokens and "
    "time to a loss, DiLoCo against plain over shaped links",
    shaped=Run.of(sys.modules[__name__], report=markdown, out="docs/benchmarks/lm_diloco",
                  quick=True))
