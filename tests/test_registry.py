"""The benchmarks' layout (harness, sections), benchmarks.registry and the one entry
point, `python -m benchmarks SECTION`."""

import ast
import importlib
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

from benchmarks import __main__ as entry
from benchmarks import registry
from benchmarks.harness import section as section_lib
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
  for section in registry.all_sections():
    assert section.runs and set(section.runs) <= set(section_lib.PLACES), section.name
  assert set(registry.section("network").runs) == {"shaped", "rig"}


def _measurement_modules() -> list[str]:
  """Every module of benchmarks.sections that defines `NAME` (a worker measurement)."""
  return sorted(str(p.relative_to(ROOT).with_suffix("")).replace("/", ".")
                for p in (BENCHMARKS / "sections").rglob("*.py")
                if re.search(r"^NAME = ", p.read_text(), re.M))


def test_every_run_module_has_a_main_and_every_measurement_a_run():
  for section in registry.all_sections():
    if section.extra is None:
      for run in section.runs.values():
        assert callable(run.load().main), section.name
  measurements = _measurement_modules()
  assert len(measurements) >= 10, measurements
  names = [importlib.import_module(name).NAME for name in measurements]
  assert len(names) == len(set(names)), names  # the job results' keys
  for name in measurements:
    assert callable(importlib.import_module(name).run), name


def test_sections_with_an_extra_have_a_main_where_it_is_installed():
  """Skips naming the extra where it is missing (a failure under CI, which installs it)."""
  sections = [s for s in registry.all_sections() if s.extra]
  assert {s.extra for s in sections} <= set(section_lib.EXTRAS)
  launch.require([m for m in (s.missing_extra() for s in sections) if m],
                 "the torch-peer extra")
  for section in sections:
    for run in section.runs.values():
      assert callable(run.load().main), section.name


def _modules() -> dict[str, pathlib.Path]:
  return {str(p.relative_to(ROOT).with_suffix("")).replace("/", ".").removesuffix(".__init__"): p
          for p in BENCHMARKS.rglob("*.py")}


def _imports(path: pathlib.Path, modules) -> set[str]:
  """The modules of `modules` that `path` imports (`from a.b import c` is a.b.c when that
  is a module, else a.b), at any depth of the file (lazy imports count)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        name = f"{node.module}.{alias.name}"
        found.add(name if name in modules else node.module)
    elif isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
  return {name for name in found if name in modules}


def test_no_import_circle_and_no_arrow_back_up():
  """harness never imports a section or the registry; a section never imports the
  registry or the entry point; jdist never imports benchmarks; no import circle."""
  modules = _modules()
  graph = {name: _imports(path, modules) for name, path in modules.items()}
  top = {"benchmarks", "benchmarks.registry", "benchmarks.__main__"}
  for name, targets in graph.items():
    if name.startswith("benchmarks.harness"):
      assert not {t for t in targets if not t.startswith("benchmarks.harness")}, name
    if name.startswith("benchmarks.sections"):
      assert not targets & top, name
  for path in (ROOT / "jdist").rglob("*.py"):
    assert not re.search(r"^\s*(from|import) benchmarks\b", path.read_text(), re.M), path
  state: dict[str, int] = {}

  def visit(name, trail):
    state[name] = 1
    for target in graph[name]:
      assert state.get(target) != 1, " -> ".join(trail + [name, target])
      if target not in state:
        visit(target, trail + [name])
    state[name] = 2

  for name in graph:
    if name not in state:
      visit(name, [])


def test_sections_declare_themselves_and_the_registry_names_no_module():
  found = {info.name for info in pkgutil.iter_modules([str(BENCHMARKS / "sections")])}
  declared = {s.name for s in registry.all_sections() if not s.internal}
  assert len(declared) == len(found), (declared, found)
  for section in registry.all_sections():
    for run in section.runs.values():
      assert callable(run.load) and (run.report is None or callable(run.report))
  assert "import_module(" not in (BENCHMARKS / "registry.py").read_text().replace(
      "importlib.import_module(f\"{sections_pkg.__name__}", "")


def test_no_module_imports_an_extra_unless_its_section_needs_it():
  """Every other module imports with the extras' modules blocked (whether installed or not)."""
  own = {"benchmarks.harness.torch_peer", "benchmarks.sections.time_to_accuracy.torch_trainer"}
  modules = sorted(name for name in _modules() if name not in own and name != "benchmarks.__main__")
  blocked = sorted(section_lib.EXTRAS.values())
  code = ("import importlib, sys\n"
          f"sys.modules.update(dict.fromkeys({blocked!r}))\n"
          f"for name in {modules!r}:\n"
          "  importlib.import_module(name)\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True,
                          capture_output=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]


def test_a_section_without_its_extra_is_a_usage_error_naming_it(monkeypatch):
  monkeypatch.setitem(section_lib.EXTRAS, "torch-peer", "no_such_module_jdist")
  with pytest.raises(SystemExit) as raised:
    entry.parse_args(["torch_peer", "--out", "x", "--config", "{}"])
  assert raised.value.code == 2


def test_each_report_has_exactly_one_writer():
  """A run names one renderer; no renderer serves two runs; only benchmarks.harness.outputs
  opens a .md file for writing."""
  renderers = [(s.name, place, run.report) for s in registry.all_sections()
               for place, run in s.runs.items() if run.report]
  assert all(callable(render) for _, _, render in renderers)
  assert len({id(render) for *_, render in renderers}) == len(renderers)
  assert ("suite", "host") in {(name, place) for name, place, _ in renderers}
  for path in BENCHMARKS.rglob("*.py"):
    if path.name != "outputs.py":
      text = path.read_text()
      assert '.md"), "w"' not in text and "md_name" not in text.replace(
          "md_name=", ""), f"{path.name} writes a Markdown file itself"


def test_only_the_entry_point_parses_arguments():
  """No module but __main__ builds an ArgumentParser or runs as `python -m benchmarks.X`."""
  offenders = []
  for path in BENCHMARKS.rglob("*.py"):
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
  assert entry.parse_args(["jax_peers", "--on", "rig"]).out.endswith("jax_peers_rig")
  with pytest.raises(SystemExit):  # the rig splits each job's processes over its 2 nodes
    entry.parse_args(["jax_peers", "--on", "rig", "--topologies", "3x1"])


def test_the_docs_list_every_section():
  page = (ROOT / "docs" / "benchmarks" / "index.md").read_text()
  for section in registry.all_sections():
    if not section.internal:
      assert f"| `{section.name}` | {', '.join(section.runs)} |" in page, section.name
