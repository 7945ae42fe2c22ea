"""Time to a test accuracy: jdist's modes against PyTorch DDP on shaped links.

    python -m benchmarks time_to_accuracy [--links 1gbit,100mbit]
        [--variants ddp,plain@1gbit,powersgd4,powersgd1] [--full plain,powersgd4,powersgd1]
        [--target 0.88] [--epochs 4] [--eval-every N] [--dataset auto|fashion_mnist|digits]
        [--max-seconds S] [--max-seconds-of NAME[@LINK]=S,...]
        [--limit N] [--out DIR] [--quick] [--render JSON]

Each (link, variant) is one job of 2 processes x 1 device in the link's fresh
shaped namespace (shm: none), training SINGA's CNN to `--target` test accuracy
(`benchmarks.sections.time_to_accuracy.train`): jdist's modes
(`benchmarks.sections.accuracy.MODES`), `<mode>_paired` (a DiLoCo mode with
its compute floors in the same job) and DDP over gloo (`ddp`, `ddp_fp16`,
`ddp_powersgd`, `ddp_postlocal`), from the same weights, data order and rows
per rank. A variant is `NAME` (every link) or `NAME@LINK`; the variants
in `--full` train every epoch instead of stopping at the target; `--max-seconds`
(`--max-seconds-of` per variant) caps a run, whose seconds then bound its time
to the target. The method and the measured runs: docs/communication.md (time to
accuracy) and docs/diloco.md.

Writes time_to_accuracy.json and .md into --out after every run
(`benchmarks.sections.time_to_accuracy.report`); links and torch variants this
machine cannot run are skipped with the reason. `--render JSON` rewrites the
Markdown of an earlier run. The defaults take about 40 minutes on 2 cores;
`--quick` (digits, target 0.5, plain and DDP on shm and 1gbit) about two.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

from benchmarks.harness import jobs as jobs_lib
from benchmarks.harness import netns
from benchmarks.harness import outputs
from benchmarks.harness import report
from benchmarks.harness.section import UsageError
from benchmarks.sections import accuracy
from benchmarks.sections.network import shaped as network
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
  """`(variant, link)` pairs of `"NAME,NAME@LINK,..."` over `links`, in order (NAME in `choices`).

  Raises:
    ValueError: an unknown variant, or a link not in `links`.
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
  """`{(variant, link): seconds}` of `"NAME=S,NAME@LINK=S,..."` over `links`.

  Raises:
    ValueError: an entry without `=S`, S not a positive number, or a bad name or link.
  """
  caps = {}
  for entry in filter(None, (e.strip() for e in text.split(","))):
    name, sep, seconds = entry.partition("=")
    try:
      value = float(seconds) if sep else -1.0
    except ValueError:
      value = -1.0
    if value <= 0:
      raise ValueError(f"{entry!r} must be NAME=SECONDS or NAME@LINK=SECONDS with "
                       "SECONDS > 0, e.g. ddp@10mbit=120")
    caps.update({pair: value for pair in parse_variants(name, links, choices)})
  return caps


def variant_job(link: netns.Link, variant: str, options: dict[str, Any]) -> jobs_lib.Job:
  """The job training `variant` on `link` (placed in its namespace by the caller)."""
  env = network.gloo_env() if variant in train_to_target.TORCH_VARIANTS else ()
  return jobs_lib.Job(f"{variant}@{link.name}", 2, 1, (train_to_target,), env=env,
                      options=tuple(dict(options, variant=variant).items()))


def run_record(link: str, variant: str, result: dict) -> dict[str, Any]:
  """One run's curve, final row and error (None when it went well), from its job."""
  section = result.get("sections", {}).get(train_to_target.NAME, {})
  rows = section.get("rows", [])
  final = next((r for r in rows if r["kind"] == "final"), None)
  framework = "torch" if variant in train_to_target.TORCH_VARIANTS else "jdist"
  return {"link": link, "variant": variant, "framework": framework,
          "curve": [r for r in rows if r["kind"] == "eval"], "final": final,
          "error": result.get("error") or section.get("error"), "wall_s": result["wall_s"]}


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None] = print,
                  progress: Callable[[dict], None] | None = None) -> dict[str, Any]:
  """Runs every (link, variant) job of `args` and returns the results (summary included).

  Args:
    args: `parse_args`'s namespace.
    log: takes each progress line.
    progress: called with the results so far (summary included) after each run.
  """
  start = time.perf_counter()
  environment = network.environment()  # load average at the start
  links, skipped = network.available_links(netns.link_named(n) for n in args.links)
  plan = [(variant, link) for variant, link in args.variants
          if link in {l.name for l in links}]
  torch_reason = network.torch_missing()
  if torch_reason and any(v in train_to_target.TORCH_VARIANTS for v, _ in plan):
    skipped.append(torch_reason)
    plan = [(v, l) for v, l in plan if v not in train_to_target.TORCH_VARIANTS]
  for reason in skipped:
    log(f"[time_to_accuracy] SKIPPED {reason}")
  options = {"dataset": args.dataset, "limit": args.limit, "epochs": args.epochs,
             "batch": args.batch, "target": args.target, "eval_every": args.eval_every}
  netns.remove_stale()
  runs = []

  def results_now() -> dict[str, Any]:
    environment["load_average_end"] = list(os.getloadavg())
    results = {"command": args.command, "environment": environment, "skipped": skipped,
               "options": dict(options, stop_at_target=args.stop_at_target,
                               full=[f"{v}@{l}" for v, l in plan if (v, l) in args.full],
                               max_seconds=args.max_seconds,
                               caps={f"{v}@{l}": c for (v, l), c in args.caps.items()},
                               learning_rate=accuracy.LEARNING_RATE,
                               momentum=accuracy.MOMENTUM),
               "runs": list(runs), "wall_s": time.perf_counter() - start}
    results["summary"] = time_to_accuracy_report.summarize(results)
    return results

  for link in links:
    variants = [v for v, l in plan if l == link.name]
    if not variants:
      continue
    with network.link_namespace(link) as name:
      for variant in variants:
        stop = args.stop_at_target and (variant, link.name) not in args.full
        cap = args.caps.get((variant, link.name), args.max_seconds)
        job = network.in_namespace(variant_job(link, variant, dict(
            options, stop_at_target=stop, max_seconds=cap)), name)
        result = jobs_lib.run(job, quick=False, timeout=args.timeout, log=log)
        runs.append(run_record(link.name, variant, result))
        if progress is not None:
          progress(results_now())
  return results_now()


def write_outputs(results: dict, out_dir: str) -> list[str]:
  """time_to_accuracy.json and .md into `out_dir`; returns the files written."""
  return outputs.write_report(out_dir, results, time_to_accuracy_report.markdown,
                              json_name="time_to_accuracy.json", md_name="time_to_accuracy.md")


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The section's options; `--quick` (the settings of `QUICK`) and `--out` are common."""
  parser.add_argument("--links", help=f"comma-separated, from "
                      f"{','.join(l.name for l in netns.LINKS)} (default {DEFAULTS['links']})")
  parser.add_argument("--variants", help="comma-separated NAME or NAME@LINK, NAME from "
                      f"{','.join(VARIANTS)} (default {DEFAULTS['variants']})".replace("%", "%%"))
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
  add_cap_arguments(parser, "time_to_accuracy.json", JOB_TIMEOUT)


def add_cap_arguments(parser: argparse.ArgumentParser, json_name: str, timeout: float) -> None:
  """--max-seconds, --max-seconds-of, --timeout and --render (also `benchmarks.sections.lm_diloco.run`'s)."""
  parser.add_argument("--max-seconds", type=float, default=0.0,
                      help="cap each run at this many training seconds (default 0: none)")
  parser.add_argument("--max-seconds-of", default="", metavar="NAME[@LINK]=S,...",
                      help="per-variant caps, over --max-seconds")
  parser.add_argument("--timeout", type=float, default=timeout,
                      help="seconds before a job is killed")
  parser.add_argument("--render", metavar="JSON", help="measure nothing: re-derive the "
                      f"summary of a {json_name} and rewrite its .md into --out "
                      "(default the JSON's directory)")


def check(args: argparse.Namespace) -> None:
  """Fills the defaults (of --quick or the full run) and parses the variant lists."""
  base = dict(QUICK if args.quick else DEFAULTS)
  if args.variants is not None:  # the default --full goes with the default --variants
    base["full"] = ""
  for key, value in base.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  try:
    args.links = [netns.link_named(n.strip()).name for n in args.links.split(",")]
    args.variants = parse_variants(args.variants, args.links)
    args.full = set(parse_variants(args.full, args.links))
    args.caps = parse_caps(args.max_seconds_of, args.links)
  except ValueError as err:
    raise UsageError(str(err)) from err
  if (args.epochs < 1 or args.batch < 1 or args.eval_every < 0 or not 0 < args.target <= 1
      or args.max_seconds < 0):
    raise UsageError("--epochs and --batch must be >= 1, --eval-every >= 0 (0: a "
                              "quarter epoch), --target in (0, 1], --max-seconds >= 0 (0: no "
                              "cap).")


def main(args: argparse.Namespace) -> int:
  if args.render:
    network.render(args.render, time_to_accuracy_report.summarize, write_outputs, args.out)
    return 0
  netns.terminate_on_sigterm()  # so a killed run still deletes its namespace
  results = run_benchmark(args, progress=lambda partial: write_outputs(partial, args.out))
  written = write_outputs(results, args.out)
  report.print_targets(results["summary"]["targets"])
  for run in results["runs"]:
    final = run["final"] or {}
    print(f"{run['variant']}@{run['link']}: time to target "
          f"{final.get('time_to_target_s')} s, last accuracy {final.get('final_accuracy')}"
          + (f", FAILED: {run['error'].splitlines()[0][:200]}" if run["error"] else ""))
  print(f"Wrote {', '.join(written)} into {args.out} in {results['wall_s']:.0f} s.")
  return 1 if any(run["error"] for run in results["runs"]) else 0
