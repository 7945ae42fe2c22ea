"""Writes every benchmark report: the results as JSON, the Markdown its renderer makes.

Each section's run names its renderer (`Run(report=...)`, benchmarks.harness.section);
the sections hand their results here, so a report file has one writer.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable


def write_report(out_dir: str, results: dict[str, Any], render: Callable[[dict], str], *,
                 json_name: str, md_name: str) -> list[str]:
  """Writes `results` to `out_dir/json_name` and `render(results)` to `out_dir/md_name`.

  Returns:
    The names written, JSON first.
  """
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
