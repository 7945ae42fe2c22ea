"""The time-to-accuracy benchmark's analysis: ratios, bounds, best mode, targets.

Per link, each variant's time to the target against DDP plain's; at `TARGET_LINK` the
issue's two targets, or with `SLOW_LINK` issue 28's (`slow_targets`). A run that did not
reach the target gives a lower bound ("<=" / ">=" ratios, decided only when the bound
settles it). The targets: docs/diloco.md.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import report

TARGET_LINK = "100mbit"
TIME_RATIO_BOUND = 0.4
ACCURACY_BOUND = 0.01
REFERENCE = "ddp"  # DDP plain
PLAIN = "plain"
FLOOR = "compute_floor"
NO_SYNC = "_nosync"  # benchmarks.sections.accuracy.NO_SYNC: a DiLoCo mode's own floor, never syncing
PAIRED = "_paired"  # benchmarks.sections.accuracy.PAIRED: a DiLoCo mode and its floors in one job


SLOW_LINK = "10mbit"
SLOW_BOUNDS = {"current": 0.5, "ddp": 0.1, "ddp_best": 0.5, "floor": 1.1}
DDP_VARIANTS = ("ddp", "ddp_fp16", "ddp_powersgd", "ddp_postlocal")


def _ratio(a: float | None, b: float | None) -> float | None:
  return None if a is None or b is None or b <= 0 else a / b


def is_diloco(variant: str) -> bool:
  """A DiLoCo mode that syncs (its `*_nosync` floor is not one)."""
  return "diloco" in variant and not variant.endswith(NO_SYNC)


def is_local(variant: str) -> bool:
  """DiLoCo and local SGD modes: not one of jdist's current (every-step) modes."""
  return is_diloco(variant) or variant.startswith("local_sgd")


def time_or_bound(row: dict) -> tuple[float | None, bool]:
  """`(seconds, exact)`: the time to the target, or (not reached: capped or out of
  epochs) the training seconds it ran, a lower bound on it."""
  if row.get("time_to_target_s") is not None:
    return row["time_to_target_s"], True
  return row.get("train_s"), False


def bounded_ratio(a: dict, b: dict) -> tuple[float | None, str]:
  """a's time / b's time, and "=" (exact), "<=" (b not reached), ">=" (a not reached)."""
  (ta, ea), (tb, eb) = time_or_bound(a), time_or_bound(b)
  if not (ea or eb) or ta is None or tb is None or tb <= 0:
    return None, ""
  return ta / tb, "=" if ea and eb else "<=" if ea else ">="


def decide(value: float | None, kind: str, bound: float) -> bool | None:
  """Whether `value` (exact or a bound of `kind`) is <= `bound`; None: undecided."""
  if value is None:
    return None
  if kind == "=":
    return value <= bound
  if kind == "<=":
    return True if value <= bound else None
  return False if value > bound else None


def show_ratio(value: float | None, kind: str) -> str:
  if value is None:
    return "—"
  return (kind + " " if kind in ("<=", ">=") else "") + report.num(value, 3)


def link_rows(runs: list[dict], link: str) -> list[dict]:
  """One row per variant run on `link`: its final figures and the ratio to DDP plain."""
  mine = [r for r in runs if r["link"] == link]
  finals = {r["variant"]: r.get("final") or {} for r in mine}
  reference = finals.get(REFERENCE)
  rows = []
  for run in mine:
    final = finals[run["variant"]]
    ratio, kind = bounded_ratio(final, reference) if reference else (None, "")
    rows.append({"variant": run["variant"], "framework": run.get("framework"),
                 "error": run.get("error"), **final, "vs_ddp": ratio, "vs_ddp_kind": kind})
  return rows


def fastest_jdist(rows: list[dict]) -> dict | None:
  """The jdist row with the shortest time to the target (None: none reached it)."""
  reached = [r for r in rows if r.get("framework") == "jdist"
             and r.get("time_to_target_s") is not None and not is_local(r["variant"])]
  return min(reached, key=lambda r: r["time_to_target_s"], default=None)


def accuracy_after_all_epochs(runs: list[dict], variant: str,
                              link: str) -> tuple[float | None, str | None]:
  """`variant`'s accuracy after every epoch, from `link`'s run or else another link's.

  Returns:
    `(accuracy, the link it was measured on)`, or `(None, None)` when no run
    of `variant` trained every epoch.
  """
  candidates = sorted((r for r in runs if r["variant"] == variant and r.get("final")
                       and r["final"].get("completed_all_epochs")),
                      key=lambda r: r["link"] != link)
  if not candidates:
    return None, None
  return candidates[0]["final"]["final_accuracy"], candidates[0]["link"]


def targets(runs: list[dict], epochs: int) -> list[dict]:
  """The issue's two targets at `TARGET_LINK` (measured None: not measured, with why)."""
  rows = link_rows(runs, TARGET_LINK)
  best = fastest_jdist(rows)
  reference = next((r for r in rows if r["variant"] == REFERENCE), None)
  time_target = {"target": "time to target: fastest jdist mode / DDP plain",
                 "where": TARGET_LINK, "bound": f"<= {TIME_RATIO_BOUND}", "measured": None,
                 "met": None, "note": ""}
  accuracy_target = {"target": f"accuracy after {epochs} epochs: fastest jdist mode - "
                     "jdist plain", "where": TARGET_LINK, "bound": f"within {ACCURACY_BOUND}",
                     "measured": None, "met": None, "note": ""}
  if not rows:
    note = f"{TARGET_LINK} was not run"
    time_target["note"] = accuracy_target["note"] = note
    return [time_target, accuracy_target]
  if best is None:
    time_target["note"] = accuracy_target["note"] = "no jdist mode reached the target"
    return [time_target, accuracy_target]
  time_target["where"] = accuracy_target["where"] = f"{TARGET_LINK} ({best['variant']})"
  if reference is None or reference.get("time_to_target_s") is None:
    time_target["note"] = ("DDP plain did not run" if reference is None
                           else "DDP plain did not reach the target")
  else:
    time_target["measured"] = best["vs_ddp"]
    time_target["met"] = best["vs_ddp"] <= TIME_RATIO_BOUND
    time_target["note"] = (f"{best['time_to_target_s']:.0f} s / "
                           f"{reference['time_to_target_s']:.0f} s")
  mode, mode_link = accuracy_after_all_epochs(runs, best["variant"], TARGET_LINK)
  plain, plain_link = accuracy_after_all_epochs(runs, PLAIN, TARGET_LINK)
  if mode is None or plain is None:
    missing = [name for name, value in ((best["variant"], mode), (PLAIN, plain))
               if value is None]
    accuracy_target["note"] = (f"{' and '.join(missing)} did not train all {epochs} "
                               f"epochs on any link of this run (add it to --full)")
  else:
    accuracy_target["measured"] = mode - plain
    accuracy_target["met"] = abs(mode - plain) <= ACCURACY_BOUND
    accuracy_target["note"] = (f"{best['variant']} {mode:.4f} (on {mode_link}) - plain "
                               f"{plain:.4f} (on {plain_link})")
  return [time_target, accuracy_target]


def fastest(rows: list[dict], keep) -> dict | None:
  """Among the rows `keep` accepts, the one reached soonest, else the one with the
  longest lower bound (None: no row)."""
  mine = [r for r in rows if keep(r) and r.get("train_s") is not None]
  reached = [r for r in mine if r.get("time_to_target_s") is not None]
  if reached:
    return min(reached, key=lambda r: r["time_to_target_s"])
  return max(mine, key=lambda r: r["train_s"], default=None)


def _describe(row: dict) -> str:
  seconds, exact = time_or_bound(row)
  return (f"{row['variant']} {seconds:.0f} s" if exact else
          f"{row['variant']} not reached in {seconds:.0f} s")


def _slow_ratio(name: str, best: dict, other: dict | None, bound: float, where: str) -> dict:
  target = {"target": f"time to target: fastest DiLoCo / {name}", "where": where,
            "bound": f"<= {bound}", "measured": None, "kind": "", "met": None, "note": ""}
  if other is None:
    target["note"] = f"{name} did not run"
    return target
  value, kind = bounded_ratio(best, other)
  target.update(measured=value, kind=kind, met=decide(value, kind, bound),
                where=f"{where} ({best['variant']} / {other['variant']})",
                note=f"{_describe(best)} / {_describe(other)}")
  if value is None:
    target["note"] += " (neither reached the target)"
  return target


def at_step(runs: list[dict], variant: str, step: int) -> tuple[float | None, str | None]:
  """`variant`'s test accuracy after `step` steps, from any link's curve."""
  for run in runs:
    for point in run.get("curve", []) if run["variant"] == variant else []:
      if point["step"] == step:
        return point["test_accuracy"], run["link"]
  return None, None


def floor_targets(runs: list[dict]) -> list[dict]:
  """Every `*_paired` run's floor rows at `TARGET_LINK` ([] without one)."""
  return [row for run in runs if run["link"] == TARGET_LINK for row in _paired_floors(run)]


NO_PAIRED_RUN = {"target": "time to target: DiLoCo / its compute floors, step by step in "
                 "the same job", "where": TARGET_LINK, "bound": f"<= {SLOW_BOUNDS['floor']}",
                 "measured": None, "kind": "", "met": None,
                 "note": f"no <mode>{PAIRED} run reached the target there"}


def _paired_floors(run: dict) -> list[dict]:
  """A `<mode>_paired` run (`train_to_target.PairedTrainer`) that reached the target:
  its time against each floor's seconds for the same steps, in the same job."""
  final = run.get("final") or {}
  floors, step = final.get("paired_floors"), final.get("reached_step")
  if not floors or not step or final.get("time_to_target_s") is None:
    return []
  names = {FLOOR: "the compute floor", final["paired_mode"] + NO_SYNC:
           "the same DiLoCo step never syncing"}
  rows = []
  for name, totals in floors.items():
    value = final["time_to_target_s"] / totals[step - 1]
    rows.append({"target": f"time to target: DiLoCo / {names.get(name, name)}, "
                           "step by step in the same job",
                 "where": f"{TARGET_LINK} ({run['variant']})",
                 "bound": f"<= {SLOW_BOUNDS['floor']}", "measured": value, "kind": "=",
                 "met": value <= SLOW_BOUNDS["floor"],
                 "note": f"{final['time_to_target_s']:.1f} s / {totals[step - 1]:.1f} s "
                         f"at step {step}"})
  return rows


def slow_targets(runs: list[dict]) -> list[dict]:
  """Issue 28's targets: DiLoCo at `SLOW_LINK` and against its floor at `TARGET_LINK`."""
  rows = link_rows(runs, SLOW_LINK)
  best = fastest(rows, lambda r: is_diloco(r["variant"]))
  if best is None:
    return [{"target": "time to target: fastest DiLoCo", "where": SLOW_LINK, "bound": "",
             "measured": None, "kind": "", "met": None, "note": "no DiLoCo mode ran"}]
  found = [
      _slow_ratio("jdist's fastest current mode", best, fastest(
          rows, lambda r: r.get("framework") == "jdist" and not is_local(r["variant"])),
                  SLOW_BOUNDS["current"], SLOW_LINK),
      _slow_ratio("DDP plain", best, next((r for r in rows if r["variant"] == REFERENCE),
                                          None), SLOW_BOUNDS["ddp"], SLOW_LINK),
      _slow_ratio("fastest DDP variant", best, fastest(
          rows, lambda r: r["variant"] in DDP_VARIANTS), SLOW_BOUNDS["ddp_best"], SLOW_LINK)]
  found += floor_targets(runs) or [dict(NO_PAIRED_RUN)]
  accuracy = {"target": "test accuracy at equal steps: fastest DiLoCo - jdist plain",
              "where": best["variant"], "bound": f">= -{ACCURACY_BOUND} (at most one point "
              "below)",
              "measured": None, "kind": "", "met": None, "note": ""}
  curve = next(r["curve"] for r in runs if r["link"] == SLOW_LINK
               and r["variant"] == best["variant"])
  for point in reversed(curve):  # the last step plain was also evaluated at
    plain, plain_link = at_step(runs, PLAIN, point["step"])
    if plain is not None:
      accuracy.update(measured=point["test_accuracy"] - plain, kind="=",
                      met=point["test_accuracy"] - plain >= -ACCURACY_BOUND,
                      note=f"step {point['step']} (epoch {point['epoch']:.2f}): "
                      f"{best['variant']} {point['test_accuracy']:.4f} (on {SLOW_LINK}) - "
                      f"plain {plain:.4f} (on {plain_link})")
      break
  else:
    accuracy["note"] = "plain has no evaluation at any of its steps (add plain@shm)"
  return found + [accuracy]


def summarize(results: dict) -> dict[str, Any]:
  """Per link rows and fastest jdist mode, and the targets."""
  runs = results["runs"]
  links = list(dict.fromkeys(r["link"] for r in runs))
  per_link = {link: link_rows(runs, link) for link in links}
  return {"links": per_link,
          "fastest_jdist": {link: (fastest_jdist(rows) or {}).get("variant")
                            for link, rows in per_link.items()},
          "targets": (slow_targets(runs) if SLOW_LINK in links
                      else targets(runs, int(results["options"]["epochs"]))
                      + floor_targets(runs))}
