"""Time to a test accuracy: jdist's modes against PyTorch DDP on shaped links.

    python -m benchmarks time_to_accuracy [--links 1gbit,100mbit]
        [--variants ddp,plain@1gbit,powersgd4,powersgd1] [--full plain,powersgd4,powersgd1]
        [--target 0.88] [--epochs 4] [--max-seconds S] [--max-seconds-of NAME[@LINK]=S,...]

One 2x1 job per (link, variant); a variant is `NAME` (every link) or `NAME@LINK`. The method
and the runs: docs/communication.md, docs/diloco.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

from benchmarks.harness import jobs as jobs_lib
from benchmarks.harness import netns
from benchmarks.harness import outputs
from benchmarks.harness import report as harness_report
from benchmarks.harness.section import Run, UsageError, section, torch_missing
from benchmarks.sections import accuracy
from benchmarks.sections.time_to_accuracy import report as time_to_accuracy_report
from benchmarks.sections.time_to_accuracy import train as train_to_target

VARIANTS = (tuple(mode for mode in accuracy.MODES if not accuracy.never_syncs(mode))
            + train_to_target.TORCH_VARIANTS
            + tuple(mode + accuracy.PAIRED for mode, options in accuracy.MODES.items()
                    if "diloco" in options and not accuracy.never_syncs(mode)))
DEFAULTS = {"links": "1gbit,100mbit", "variants": "ddp,plain@1gbit,powersgd4,powersgd1",
            "full": "plain,powersgd4,powersgd1", "dataset": "auto", "epochs": 4,
            "target": 0.88}
QUICK = {"links": "shm,1gbit", "variants": "plain,ddp", "full": "", "dataset": "digits",
         "epochs": 1, "target": 0.5}
JOB_TIMEOUT = 3600  # seconds per job: DDP plain at 100 Mbit/s needs about 12 minutes


def parse_variants(text: str, links: list[str],
                   choices: tuple[str, ...] = VARIANTS) -> list[tuple[str, str]]:
  """`(variant, link)` pairs of `"NAME,NAME@LINK,..."` over `links`, in order (NAME in `choices`);
  ValueError for an unknown variant or link.
  """
  pairs = []
  for entry in filter(None, (e.strip() for e in text.split(","))):
    name, _, link = entry.partition("@")
    if name not in choices:
      raise ValueError(f"unknown variant {name!r}; choose from {', '.join(choices)}")
    if link and link not in links:
      raise ValueError(f"{entry!r}: link {link!r} is not in --links ({', '.join(links)})")
    pairs += [(name, l) for l in ([link] if link else links) if (name, l) not in pairs]
  return pairs


def parse_caps(text: str, links: list[str],
               choices: tuple[str, ...] = VARIANTS) -> dict[tuple[str, str], float]:
  """`{(variant, link): seconds}` of `"NAME=S,NAME@LINK=S,..."` over `links` (S > 0)."""
  caps = {}
  for entry in filter(None, (e.strip() for e in text.split(","))):
    name, _, seconds = entry.partition("=")
    try:
      value = float(seconds)
    except ValueError:
      value = -1.0
    if value <= 0:
      raise ValueError(f"{entry!r} must be NAME=SECONDS or NAME@LINK=SECONDS with "
                       "SECONDS > 0, e.g. ddp@10mbit=120")
    caps.update({pair: value for pair in parse_variants(name, links, choices)})
  return caps


def run_plan(args: argparse.Namespace, measurement,
             job_for: Callable[[netns.Link, str], jobs_lib.Job],
             results_of: Callable[[list[dict], list[str], list], dict[str, Any]], *,
             drop: Callable[[list], tuple[list, list[str]]] | None = None,
             log: Callable[[str], None] = print,
             progress: Callable[[dict], None] | None = None) -> dict[str, Any]:
  """Runs each `(variant, link)` of `args.variants` (`job_for(link, variant)`, `measurement`'s
  rows), a fresh shaped namespace per link; `results_of(runs, skipped, plan)` after each
  run goes to `progress`, the last is returned. `drop(plan)` -> `(plan, reasons)` leaves
  out what this machine cannot run. Also lm_diloco's driver.
  """
  links, skipped = netns.available_links(netns.link_named(n) for n in args.links)
  plan = [(v, l) for v, l in args.variants if l in {link.name for link in links}]
  if drop is not None:
    plan, reasons = drop(plan)
    skipped += reasons
  for reason in skipped:
    log(f"[{measurement.NAME}] SKIPPED {reason}")
  netns.remove_stale()
  runs = []
  for link in links:
    variants = [v for v, l in plan if l == link.name]
    if not variants:
      continue
    with netns.link_namespace(link) as name:
      for variant in variants:
        job = netns.in_namespace(job_for(link, variant), name)
        result = jobs_lib.run(job, quick=False, timeout=args.timeout, log=log)
        section = result.get("sections", {}).get(measurement.NAME, {})
        rows = section.get("rows", [])
        runs.append({"link": link.name, "variant": variant,
                     "curve": [r for r in rows if r["kind"] == "eval"],
                     "final": next((r for r in rows if r["kind"] == "final"), None),
                     "error": result.get("error") or section.get("error"),
                     "wall_s": result["wall_s"]})
        if progress is not None:
          progress(results_of(runs, skipped, plan))
  return results_of(runs, skipped, plan)


def _without_torch(plan: list[tuple[str, str]]) -> tuple[list, list[str]]:
  """`plan` less its torch variants where torch is missing, and why."""
  reason = torch_missing()
  if not reason or not any(v in train_to_target.TORCH_VARIANTS for v, _ in plan):
    return plan, []
  return [(v, l) for v, l in plan if v not in train_to_target.TORCH_VARIANTS], [reason]


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None] = print,
                  progress: Callable[[dict], None] | None = None) -> dict[str, Any]:
  """Runs every (link, variant) job of `args` (`run_plan`); returns the results, summary included."""
  start, environment = time.perf_counter(), harness_report.environment()
  options = {"dataset": args.dataset, "limit": args.limit, "epochs": args.epochs,
             "batch": args.batch, "target": args.target, "eval_every": args.eval_every}

  def results_of(runs: list[dict], skipped: list[str], plan: list) -> dict[str, Any]:
    results = harness_report.results(
        args.command, environment, start, skipped=skipped,
        options=dict(options, stop_at_target=args.stop_at_target,
                     full=[f"{v}@{l}" for v, l in plan if (v, l) in args.full],
                     max_seconds=args.max_seconds,
                     caps={f"{v}@{l}": c for (v, l), c in args.caps.items()},
                     learning_rate=accuracy.LEARNING_RATE, momentum=accuracy.MOMENTUM),
        runs=[dict(r, framework="torch" if r["variant"] in train_to_target.TORCH_VARIANTS
                   else "jdist") for r in runs])
    results["summary"] = time_to_accuracy_report.summarize(results)
    return results

  def job_for(link: netns.Link, variant: str) -> jobs_lib.Job:
    pair = (variant, link.name)
    env = netns.gloo_env() if variant in train_to_target.TORCH_VARIANTS else ()
    mine = dict(options, variant=variant, max_seconds=args.caps.get(pair, args.max_seconds),
                stop_at_target=args.stop_at_target and pair not in args.full)
    return jobs_lib.Job(f"{variant}@{link.name}", 2, 1, (train_to_target,), env=env,
                        options=tuple(mine.items()))

  return run_plan(args, train_to_target, job_for, results_of, drop=_without_torch, log=log,
                  progress=progress)


def write_outputs(results: dict, out_dir: str) -> list[str]:
  """time_to_accuracy.json and .md into `out_dir`; returns the files written."""
  return outputs.write_report(out_dir, results, time_to_accuracy_report.markdown,
                              json_name="time_to_accuracy.json", md_name="time_to_accuracy.md")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The section's options; `--quick` (the settings of `QUICK`) and `--out` are common."""
  add_plan_arguments(parser, DEFAULTS, VARIANTS, "time_to_accuracy.json", JOB_TIMEOUT)
  parser.add_argument("--full", help="variants (NAME or NAME@LINK) that train every epoch "
                      f"instead of stopping at the target (default {DEFAULTS['full']} with "
                      "the default --variants, else none)")
  parser.add_argument("--target", type=float, help="test accuracy to reach (default 0.88)")
  parser.add_argument("--epochs", type=int, help="the most epochs a run trains (default 4)")
  parser.add_argument("--stop-at-target", action=argparse.BooleanOptionalAction, default=True,
                      help="end a run (not in --full) at the target (default on)")
  parser.add_argument("--eval-every", type=int, default=0,
                      help="steps between two evaluations (default a quarter epoch)")
  parser.add_argument("--dataset", choices=("auto", "fashion_mnist", "digits"),
                      help="auto: Fashion-MNIST where installed, else digits")
  parser.add_argument("--limit", type=int, help="use only the first N training examples")
  parser.add_argument("--batch", type=int, default=32, help="examples per replica per step")


def add_plan_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any],
                       choices: tuple[str, ...], json_name: str, timeout: float) -> None:
  """--links, --variants (NAME from `choices`), --max-seconds(-of), --timeout and --render;
  also lm_diloco's.
  """
  parser.add_argument("--links", help=f"comma-separated, from "
                      f"{','.join(l.name for l in netns.LINKS)} (default {defaults['links']})")
  parser.add_argument("--variants", help="comma-separated NAME or NAME@LINK, NAME from "
                      f"{','.join(choices)} (default {defaults['variants']})".replace("%", "%%"))
  parser.add_argument("--max-seconds", type=float, default=0.0,
                      help="cap each run at this many training seconds (default 0: none)")
  parser.add_argument("--max-seconds-of", default="", metavar="NAME[@LINK]=S,...",
                      help="per-variant caps, over --max-seconds")
  parser.add_argument("--timeout", type=float, default=timeout,
                      help="seconds before a job is killed")
  parser.add_argument("--render", metavar="JSON", help="measure nothing: re-derive the "
                      f"summary of a {json_name} and rewrite its .md into --out "
                      "(default the JSON's directory)")


def parse_plan(args: argparse.Namespace, base: dict[str, Any], choices: tuple[str, ...],
               also: tuple[str, ...] = ()) -> None:
  """Fills the options `args` left unset from `base`, then parses `--links`, `--variants` (and
  each option named in `also`, into a set) and `--max-seconds-of`; also lm_diloco's.
  """
  for key, value in base.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  try:
    args.links = [netns.link_named(n.strip()).name for n in args.links.split(",")]
    args.variants = parse_variants(args.variants, args.links, choices)
    for key in also:
      setattr(args, key, set(parse_variants(getattr(args, key), args.links, choices)))
    args.caps = parse_caps(args.max_seconds_of, args.links, choices)
  except ValueError as err:
    raise UsageError(str(err)) from err


def check(args: argparse.Namespace) -> None:
  """Fills the defaults (of --quick or the full run) and parses the variant lists."""
  base = dict(QUICK if args.quick else DEFAULTS)
  if args.variants is not None:  # the default --full goes with the default --variants
    base["full"] = ""
  parse_plan(args, base, VARIANTS, also=("full",))
  if (args.epochs < 1 or args.batch < 1 or args.eval_every < 0 or not 0 < args.target <= 1
      or args.max_seconds < 0):
    raise UsageError("--epochs and --batch must be >= 1, --eval-every >= 0 (0: a "
                     "quarter epoch), --target in (0, 1], --max-seconds >= 0 (0: no cap).")


def main(args: argparse.Namespace) -> int:
  done = outputs.measure_or_render(args, lambda each: run_benchmark(args, progress=each),
                                   time_to_accuracy_report.summarize, write_outputs)
  if done is None:
    return 0
  results, written = done
  harness_report.print_targets(results["summary"]["targets"])
  for run in results["runs"]:
    final = run["final"] or {}
    print(f"{run['variant']}@{run['link']}: time to target "
          f"{final.get('time_to_target_s')} s, last accuracy {final.get('final_accuracy')}"
          + (f", FAILED: {run['error'].splitlines()[0][:200]}" if run["error"] else ""))
  print(f"Wrote {', '.join(written)} into {args.out} in {results['wall_s']:.0f} s.")
  return 1 if any(run["error"] for run in results["runs"]) else 0


SECTION = section(
    "time_to_accuracy", "seconds to a test accuracy, jdist's modes against PyTorch DDP over "
    "shaped links",
    shaped=Run.of(sys.modules[__name__], report=time_to_accuracy_report.markdown,
                  out="docs/benchmarks/time_to_accuracy", quick=True))
