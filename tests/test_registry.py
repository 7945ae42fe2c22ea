"""benchmarks.registry and the one entry point, `python -m benchmarks SECTION`."""

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

from benchmarks import __main__ as entry
from benchmarks import registry
from tests import launch

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _run(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=ROOT, text=True,
                        capture_output=True, timeout=120, check=False)


def test_every_section_is_registered_once_with_places_it_can_run():
  names = registry.names(internal=True)
  assert len(names) == len(set(names))
  assert {"suite", "network", "time_to_accuracy", "faults", "lm_diloco"} <= set(names)
  for section in registry.SECTIONS:
    assert section.runs and set(section.runs) <= set(registry.PLACES), section.name
  assert set(registry.section("network").runs) == {"shaped", "rig"}


def test_every_run_module_has_a_main_and_every_measurement_a_run():
  for section in registry.SECTIONS:
    if section.extra is None:
      for run in section.runs.values():
        assert callable(registry.module(run).main), f"{section.name}: {run.module}"
  for name, module in registry.MEASUREMENTS.items():
    assert callable(importlib.import_module(f"benchmarks.{module}").run), name


def test_sections_with_an_extra_have_a_main_where_it_is_installed():
  """Skips naming the extra where it is missing (a failure under CI, which installs it)."""
  sections = [s for s in registry.SECTIONS if s.extra]
  assert {s.extra for s in sections} <= set(registry.EXTRAS)
  launch.require([m for m in map(registry.missing_extra, sections) if m],
                 "the torch-peer extra")
  for section in sections:
    for run in section.runs.values():
      assert callable(registry.module(run).main), f"{section.name}: {run.module}"


def test_no_module_imports_an_extra_unless_its_section_needs_it():
  """Every other module imports with the extras' modules blocked (whether installed or not)."""
  own = {run.module for s in registry.SECTIONS if s.extra for run in s.runs.values()}
  own.add("torch_accuracy")  # the torch side of the time-to-accuracy measurement
  modules = sorted(p.stem for p in BENCHMARKS.glob("*.py")
                   if p.stem not in own and p.stem != "__main__")
  blocked = sorted(registry.EXTRAS.values())
  code = ("import importlib, sys\n"
          f"sys.modules.update(dict.fromkeys({blocked!r}))\n"
          f"for name in {modules!r}:\n"
          "  importlib.import_module('benchmarks.' + name)\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True,
                          capture_output=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]


def test_a_section_without_its_extra_is_a_usage_error_naming_it(monkeypatch):
  monkeypatch.setitem(registry.EXTRAS, "torch-peer", "no_such_module_jdist")
  with pytest.raises(SystemExit) as raised:
    entry.parse_args(["torch_peer", "--out", "x", "--config", "{}"])
  assert raised.value.code == 2


def test_each_report_has_exactly_one_writer():
  """A run names one renderer; no renderer serves two runs; only benchmarks.outputs
  opens a .md file for writing."""
  renderers = [(s.name, place, registry.renderer(run)) for s in registry.SECTIONS
               for place, run in s.runs.items() if run.report]
  assert all(callable(render) for _, _, render in renderers)
  assert len({id(render) for *_, render in renderers}) == len(renderers)
  assert ("suite", "host") in {(name, place) for name, place, _ in renderers}
  for path in BENCHMARKS.glob("*.py"):
    if path.name != "outputs.py":
      text = path.read_text()
      assert '.md"), "w"' not in text and "md_name" not in text.replace(
          "md_name=", ""), f"{path.name} writes a Markdown file itself"


def test_only_the_entry_point_parses_arguments():
  """No module but __main__ builds an ArgumentParser or runs as `python -m benchmarks.X`."""
  offenders = []
  for path in BENCHMARKS.glob("*.py"):
    if path.name == "__main__.py":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in ("ArgumentParser", "parse_args")):
        offenders.append(f"{path.name}: {node.func.attr}")
      if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Name)
          and node.left.id == "__name__"):
        offenders.append(f"{path.name}: if __name__ == ...")
  assert not offenders


def test_list_names_every_section():
  result = _run("list")
  assert result.returncode == 0, result.stderr
  listed = [line.split()[0] for line in result.stdout.splitlines()]
  assert listed == list(registry.names())
  assert "worker" not in listed  # internal per-rank programs are not listed


def test_unknown_section_is_an_error_naming_the_choices():
  result = _run("nope")
  assert result.returncode == 2
  assert "unknown section 'nope'" in result.stderr and "network" in result.stderr


def test_options_are_checked_per_place():
  args = entry.parse_args(["network", "--on", "rig", "--links", "1gbit"])
  assert args.on == "rig" and args.links == ["1gbit"] and args.out.endswith("cluster")
  assert entry.parse_args(["network"]).on == "shaped"
  with pytest.raises(SystemExit):
    entry.parse_args(["network", "--on", "rig", "--modes", "plain"])
  with pytest.raises(SystemExit):
    entry.parse_args(["suite", "--only", "allreduce,nope"])
  assert entry.parse_args(["--quick"]).section == "suite"  # the bare form is the suite


def test_the_docs_list_every_section():
  page = (ROOT / "docs" / "benchmarks" / "index.md").read_text()
  for section in registry.SECTIONS:
    if not section.internal:
      assert f"| `{section.name}` | {', '.join(section.runs)} |" in page, section.name
