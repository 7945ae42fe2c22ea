"""`jdist.runtime.jax_internals`: the one module that reads JAX's private modules."""

import os
import re
from importlib import metadata

import jax
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import jdist
from jdist.runtime import jax_internals

JDIST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jdist")


def test_no_private_jax_import_outside_the_compatibility_module():
  offenders = []
  for folder, _, files in os.walk(JDIST):
    for name in files:
      path = os.path.join(folder, name)
      if name.endswith(".py") and path != jax_internals.__file__:
        with open(path, encoding="utf-8") as source:
          text = source.read()
        if re.search(r"^\s*(from|import)\s+jax\._src", text, re.MULTILINE):
          offenders.append(os.path.relpath(path, JDIST))
  assert not offenders, f"jax._src imported outside jdist/runtime/jax_internals.py: {offenders}"


def test_declared_jax_range_is_the_tested_one_and_installed():
  requirements = [Requirement(r) for r in metadata.requires("jdist") or []]
  declared = [r.specifier for r in requirements if r.name == "jax" and not r.marker]
  assert declared == [SpecifierSet(jax_internals.TESTED_JAX)]
  assert jax.__version__ in declared[0]


def test_internals_answer_on_this_jax(topo):
  assert jax_internals.backends_initialized()  # the topo fixture ran JAX


def test_the_collective_layer_reads_no_jax_internals():
  collectives_dir = os.path.join(os.path.dirname(jdist.__file__), "collectives")
  for root, _, files in os.walk(collectives_dir):
    for name in files:
      if name.endswith(".py"):
        with open(os.path.join(root, name), encoding="utf-8") as f:
          text = f.read()
        assert "jax_internals" not in text and "jax._src" not in text, name
