"""Writes every benchmark report: results JSON, its Markdown and each rank's file (`Recorder`)."""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from typing import Any, Callable, Iterable

from benchmarks.harness import netns


def write_report(out_dir: str, results: dict[str, Any], render: Callable[[dict], str], *,
                 json_name: str, md_name: str) -> list[str]:
  """Writes `results` as JSON and `render(results)`; the names written."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, json_name), "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1)
  write_markdown(os.path.join(out_dir, md_name), render(results))
  return [json_name, md_name]


def write_markdown(path: str, text: str) -> None:
  """Writes one Markdown report (its directory made if missing)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)


def measure_or_render(args: argparse.Namespace, measure: Callable[[Callable], dict],
                      summarize: Callable[[dict], dict],
                      write: Callable[[dict, str], list[str]]) -> tuple[dict, list[str]] | None:
  """`--render JSON`: re-derives the summary of a results JSON and rewrites its report into
  `--out`, returning None. Otherwise `measure(progress)` (`progress(partial)` rewrites the
  report) and its report written: `(results, the files written)`.
  """
  if args.render:
    with open(args.render, encoding="utf-8") as f:
      results = json.load(f)
    results["summary"] = summarize(results)
    print(f"Rewrote {', '.join(write(results, args.out))} into {args.out}.")
    return None
  netns.terminate_on_sigterm()  # so a killed run still deletes its namespaces or rig
  results = measure(lambda partial: write(partial, args.out))
  return results, write(results, args.out)


class Recorder:
  """One rank's results, rewritten to its JSON file after every row."""

  def __init__(self, path: str, header: dict[str, Any]):
    self.path = path
    self.result = dict(header, sections={})

  def flush(self) -> None:
    with open(self.path + ".tmp", "w", encoding="utf-8") as f:
      json.dump(self.result, f, indent=1)
    os.replace(self.path + ".tmp", self.path)

  def record(self, name: str, rows: Callable[[], Iterable[dict]]) -> None:
    """Runs `rows()` and records each row it yields under section `name`."""
    section: dict[str, Any] = {"rows": [], "complete": False}
    self.result["sections"][name] = section
    self.flush()
    start = time.perf_counter()
    try:
      for row in rows():
        section["rows"].append(row)
        section["wall_s"] = time.perf_counter() - start
        self.flush()
      section["complete"] = True
    except Exception as err:  # pylint: disable=broad-except
      traceback.print_exc()
      section["error"] = f"{type(err).__name__}: {err}"
    section["wall_s"] = time.perf_counter() - start
    self.flush()
