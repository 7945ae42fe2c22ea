"""The architecture, checked: layers, import arrows, function length, light
imports.

The library (`jdist`, `jdist.runtime`, `jdist.collectives`,
`jdist.compression`, `jdist.transforms`) never imports the `jdist train`
application (`jdist.app`); the runtime and the collective layer never import
upwards into the transformations; no import cycle, counting imports inside
functions too (a lazy import is still an arrow).
"""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jdist"
MAX_FUNCTION_LINES = 80  # not counting the docstring

# Layers from the bottom up; a module may import its own layer or lower ones.
LAYERS = (
    ("jdist.errors", "jdist.runtime.jax_internals", "jdist.fusion"),
    ("jdist.runtime",),
    ("jdist.collectives",),
    ("jdist.compression",),
    ("jdist.transforms",),
    ("jdist.parallel", "jdist.consistency", "jdist.metrics", "jdist.data", "jdist.checkpoint",
     "jdist.flax_nnx", "jdist.tracing"),
    ("jdist",),  # the package's __init__: the public API
    ("jdist.app",),
)


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
  return {_module_name(path): path for path in PACKAGE.rglob("*.py")
          if "_build" not in path.parts}


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
  """Every jdist module `path` imports, at module level or inside functions."""
  name = _module_name(path)
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                        + ([base] if base else []))
      for alias in node.names:
        candidate = f"{base}.{alias.name}"
        found.add(candidate if candidate in modules else base)
  return {target for target in found if target in modules and target != name}


def _layer(module: str) -> int:
  best, best_length = None, -1
  for index, prefixes in enumerate(LAYERS):
    for prefix in prefixes:
      if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
        best, best_length = index, len(prefix)
  assert best is not None, f"{module} belongs to no layer: add it to LAYERS in {__file__}"
  return best


def test_every_module_belongs_to_a_layer_and_imports_only_downwards():
  modules = _modules()
  upward = []
  for name, path in modules.items():
    for target in _imports(path, modules):
      if target == "jdist":
        continue  # `import jdist` for the public API is the application's right only
      if _layer(target) > _layer(name):
        upward.append(f"{name} -> {target}")
  assert not upward, "imports that run up the layers:\n  " + "\n  ".join(sorted(upward))


def test_only_the_application_imports_the_public_package():
  modules = _modules()
  offenders = [name for name, path in modules.items()
               if "jdist" in _imports(path, modules) and _layer(name) < _layer("jdist.app")]
  assert not offenders, f"library modules that import the whole jdist package: {offenders}"


def test_no_import_cycle():
  modules = _modules()
  graph = {name: _imports(path, modules) - {"jdist"} for name, path in modules.items()}
  # Drop the arrow from a package's __init__ to its own modules (re-exports).
  for name in graph:
    graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
  state: dict[str, int] = {}
  stack: list[str] = []
  cycles = []

  def visit(node):
    state[node] = 1
    stack.append(node)
    for target in sorted(graph[node]):
      if state.get(target) == 1:
        cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
      elif target not in state:
        visit(target)
    stack.pop()
    state[node] = 2

  for node in sorted(graph):
    if node not in state:
      visit(node)
  assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  """The lines `node` spans (decorators and signature included), less its docstring."""
  first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
  lines = node.end_lineno - first + 1
  body = node.body
  if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)):
    lines -= body[0].end_lineno - body[0].lineno + 1
  return lines


def test_no_function_outgrows_one_head():
  """A long cohesive module is fine; a function over the limit is split into helpers."""
  long = []
  for name, path in sorted(_modules().items()):
    for node in ast.walk(ast.parse(path.read_text())):  # nested functions included
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = _function_lines(node)
        if lines > MAX_FUNCTION_LINES:
          long.append(f"{name}.{node.name} (line {node.lineno}): {lines} lines")
  assert not long, (f"functions over {MAX_FUNCTION_LINES} lines without their docstring "
                    "(split them into helpers by concern):\n  " + "\n  ".join(long))


@pytest.mark.parametrize("command", [
    "import jdist",
    "from jdist.app import cli; cli.main(['--help'])",
    "from jdist.app import cli; cli.main(['train', '--help'])",
])
def test_import_and_help_do_not_load_orbax_or_flax(command):
  probe = (f"import sys\ntry:\n  {command}\nexcept SystemExit:\n  pass\n"
           "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('orbax', 'flax'))\n"
           "print('HEAVY', heavy)\n")
  output = _run_probe(probe)
  assert "HEAVY []" in output, output[-2000:]


def _run_probe(probe: str) -> str:
  """The stdout of a fresh Python running `probe` in the repository (no fake devices)."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                        timeout=120, cwd=ROOT, env=env, check=True).stdout


def test_lazy_public_names_resolve_and_are_listed():
  import jdist  # pylint: disable=g-import-not-at-top
  for name in ("CheckpointManager", "SyncBatchNorm", "checkpoint"):
    assert name in jdist.__all__ and name in dir(jdist)
    assert getattr(jdist, name) is not None
  with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
    jdist.not_a_name  # pylint: disable=pointless-statement


def test_all_lists_the_library_only():
  import jdist  # pylint: disable=g-import-not-at-top
  import types  # pylint: disable=g-import-not-at-top
  from_app = []
  for name in jdist.__all__:
    value = getattr(jdist, name)
    module = value.__name__ if isinstance(value, types.ModuleType) else getattr(
        value, "__module__", "") or ""
    if module == "jdist.app" or module.startswith("jdist.app."):
      from_app.append(name)
  assert not from_app, f"application names in jdist.__all__: {from_app}"
  assert len(set(jdist.__all__)) == len(jdist.__all__)


@pytest.mark.parametrize("name, new", [("TrainConfig", "jdist.app.config.TrainConfig"),
                                       ("datasets", "jdist.app.datasets"),
                                       ("models", "jdist.app.models")])
def test_moved_application_names_still_resolve_with_a_deprecation_warning(name, new):
  import importlib  # pylint: disable=g-import-not-at-top
  import jdist  # pylint: disable=g-import-not-at-top
  assert name not in jdist.__all__
  with pytest.warns(DeprecationWarning, match=f"use {new}"):
    value = getattr(jdist, name)
  module, _, attribute = new.rpartition(".") if name == "TrainConfig" else (new, "", "")
  expected = importlib.import_module(module)
  assert value is (getattr(expected, attribute) if attribute else expected)


def test_the_library_core_imports_no_application_dependency():
  """scikit-learn and tqdm are the `app` extra's: `import jdist` must not need them."""
  probe = ("import sys\nimport jdist\n"
           "print('APP', sorted(m for m in sys.modules if m.split('.')[0] in "
           "('sklearn', 'tqdm') or m.startswith('jdist.app')))\n")
  output = _run_probe(probe)
  assert "APP []" in output, output[-2000:]
