"""The time-to-accuracy benchmark's Markdown report.

`markdown(results)` renders a run of `benchmarks.sections.time_to_accuracy.run` with the
figures and verdicts `benchmarks.sections.time_to_accuracy.targets.summarize` derived
(per link: each variant's time to the target, steps, median step, bytes per
step and ratio to DDP plain; the accuracy curves; the issue's targets).
"""

from __future__ import annotations

from benchmarks.harness import report
from benchmarks.sections.time_to_accuracy.targets import (  # pylint: disable=unused-import
    is_local, show_ratio, summarize)


def _seconds(row: dict) -> str:
  if row.get("time_to_target_s") is not None:
    return f"{row['time_to_target_s']:.1f}"
  last = row.get("final_accuracy")
  if row.get("train_s") is None:
    return "not reached"
  return (f"not reached in {row['train_s']:.0f} s (accuracy "
          f"{'?' if last is None else f'{last:.4f}'} at step {row['steps']})")


def _link_table(rows: list[dict]) -> list[str]:
  body = []
  for r in rows:
    if r.get("steps") is None:
      body.append([r["variant"], "failed"] + ["-"] * 6)
      continue
    reached = ("-" if r.get("reached_step") is None
               else f"{r['reached_step']} ({r['epochs_to_target']:.2f})")
    wire = r.get("wire_bytes_per_step")
    body.append([r["variant"], _seconds(r), reached,
                 report.ms(r.get("median_step_s")), report.num(r.get("first_step_s")),
                 f"{r['final_accuracy']:.4f} ({r['epochs_trained']:.2f})",
                 "—" if wire is None else report.size(wire),
                 show_ratio(r.get("vs_ddp"), r.get("vs_ddp_kind", "="))])
  return report.table(["variant", "time to target s", "steps (epochs) to target",
                       "median step ms", "first step s", "last accuracy (epochs trained)",
                       "sent per step", "time to target / DDP plain"], body)


def _header(results: dict) -> list[str]:
  options = results["options"]
  first = next((r["final"] for r in results["runs"] if r.get("final")), None)
  data = (f"{first['dataset']} ({first['train_examples']:,} train / "
          f"{first['test_examples']:,} test images), {first['steps_per_epoch']} steps per "
          f"epoch, evaluated every {first['eval_every']} steps" if first
          else f"{options['dataset']}")
  return report.header(
      "jdist: time to accuracy on shaped links", results,
      f"Method: SINGA's CNN on {data}; 2 processes x 1 device (`mpirun -np 2`), batch "
      f"{options['batch']} per replica, the same initial weights (flax's, copied into the "
      "torch model), data order and rows per rank in every variant; jdist "
      f"`dist_opt(optax.sgd({options['learning_rate']}, momentum={options['momentum']}), "
      "...)` (XLA's default CPU threads), DDP over gloo with `torch.optim.SGD` of the same "
      "rate and momentum (torch threads: cores / processes, as torchrun), its compressed "
      "variants by their comm hooks. One job per link and variant, a fresh "
      "network namespace per link (shm: none). Time = training seconds only: the clock "
      "stops while rank 0 measures the test accuracy, every "
      "`eval_every` steps; it includes the first step, which for jdist is mostly the "
      "step's compilation (column \"first step s\"). A run stops at "
      f"the first evaluation at or above {options['target']:.2f} unless it is in --full "
      f"(then it trains all {options['epochs']} epochs; here: "
      f"{', '.join(options.get('full', [])) or 'none'}).", *_local_lines(results),
      minutes=True)


def _local_lines(results: dict) -> list[str]:
  """The header's lines on DiLoCo, local SGD, the paired floors and the caps, where they ran."""
  options, variants = results["options"], {r["variant"] for r in results["runs"]}
  lines = []
  if any(is_local(v) or v == "ddp_postlocal" for v in variants):
    lines.append(
        "Low-communication modes: `dist_opt(inner, diloco=H)` (`jdist.diloco`, inner = "
        "the same SGD, outer `optax.sgd(0.7, momentum=0.9, nesterov=True)`; sdiloco32: "
        "4 fragments, no delay; _bg: `diloco_delay` (sdiloco32_bg 8, diloco128_bg 32) and "
        "`diloco_mix=0.5`, the sync in the background; _int8/_int4: "
        "`diloco_payload=\"int8\"`/`\"int4\"`), "
        "`dist_opt(inner, local_sgd=H, local_sgd_warmup=32)`; "
        "ddp_postlocal: PyTorch's `post_localSGD_hook` (start_localSGD_iter 32) + "
        "`PostLocalSGDOptimizer` with `PeriodicModelAverager(period=32, warmup_steps=32)`. "
        "Their replicas differ between syncs: an evaluation tests the replicas' average "
        "(an exchange outside the clock; on a sync step, the synced model). "
        "<mode>_paired: that DiLoCo mode, its compute floor (the same SGD steps with "
        "`jax.jit` on each rank's own rows, nothing exchanged) and its own never-syncing "
        "step (`<mode>_nosync`) a step each in turn in one job. Sent per step: the mean "
        "over the steps trained.")
  caps = ", ".join(f"{k} {v:g} s" for k, v in options.get("caps", {}).items())
  if options.get("max_seconds") or caps:
    lines.append(f"Caps (training seconds): {options.get('max_seconds') or 'none'} s "
                 f"each{'; ' + caps if caps else ''}.")
  return lines


def markdown(results: dict) -> str:
  """time_to_accuracy.md from the results (summary included)."""
  summary = results["summary"]
  lines = _header(results) + ["## Targets", ""] + report.table(
      ["target", "where", "bound", "measured", "", "from"],
      [[t["target"], t["where"], t["bound"], show_ratio(t["measured"], t.get("kind", "=")),
        "undecided" if t["met"] is None and t["measured"] is not None
        else report.STATUS[t["met"]],
        t["note"]] for t in summary["targets"]])
  if any(t.get("kind") in ("<=", ">=") for t in summary["targets"]):
    lines += ["A ratio marked <= or >= is a bound: a run that did not reach the target "
              "(capped at --max-seconds, or out of epochs) counts its training seconds, a "
              "lower bound on its time to the target.", ""]
  for link, rows in summary["links"].items():
    lines += [f"## {link}", ""] + _link_table(rows)
    runs = [r for r in results["runs"] if r["link"] == link]
    lines += ["Test accuracy (training seconds) at each evaluation:", ""] + report.curve_table(
        runs, ("epoch", lambda p: f"{p['epoch']:.2f}"),
        lambda p: f"{p['test_accuracy']:.4f} ({p['train_s']:.0f} s)")
  return "\n".join(lines + failures(results["runs"])) + "\n"


def failures(runs: list[dict]) -> list[str]:
  """The "Failures" section: each failed run's error (none: no section)."""
  return report.failures([(f"{r['variant']} on {r['link']}", r["error"])
                          for r in runs if r.get("error")])
