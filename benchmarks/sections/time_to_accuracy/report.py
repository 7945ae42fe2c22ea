"""The time-to-accuracy benchmark's Markdown report (from `targets.summarize`'s summary)."""

from __future__ import annotations

from benchmarks.harness import report
from benchmarks.sections.time_to_accuracy.targets import show_ratio


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
  caps = ", ".join(f"{k} {v:g} s" for k, v in options.get("caps", {}).items())
  return report.header(
      "jdist: time to accuracy on shaped links", results,
      f"SINGA's CNN on {data}; 2 processes x 1 device, batch {options['batch']} per "
      f"replica, SGD {options['learning_rate']} (momentum {options['momentum']}); time = "
      "training seconds, evaluations excluded, first step (mostly compilation) included. "
      f"A run stops at the first evaluation at or above {options['target']:.2f} unless in "
      f"--full (then {options['epochs']} epochs; here: "
      f"{', '.join(options.get('full', [])) or 'none'}). The method, the modes and the "
      "floors of `<mode>_paired`: docs/diloco.md (time to accuracy), docs/communication.md.",
      *([f"Caps (training seconds): {options.get('max_seconds') or 'none'} s each"
         f"{'; ' + caps if caps else ''}."] if options.get("max_seconds") or caps else []),
      minutes=True)


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
