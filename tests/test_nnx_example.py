"""examples/nnx_mnist.py: flax's NNX MNIST tutorial made data-parallel in at most 10 lines.

It must train like its single-device original (examples/nnx_mnist_single.py)
on the same global batches: the per-step losses agree to 1e-5 relative for
20 steps in every topology (1x4, 2x1, 2x2).
"""

import difflib
import importlib.util
import os

import jax
import numpy as np

import jdist
from jdist.runtime import host
from tests import launch

EXAMPLES = os.path.join(launch.REPO, "examples")
MAX_CHANGED_LINES = 10


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _code_lines(name):
  """The file's lines after its module docstring."""
  with open(os.path.join(EXAMPLES, f"{name}.py"), encoding="utf-8") as source:
    lines = source.read().splitlines()
  closing = next(i for i, line in enumerate(lines) if i > 0 and line.rstrip().endswith('"""'))
  return lines[closing + 1:]


def test_the_data_parallel_example_changes_at_most_ten_lines():
  diff = difflib.unified_diff(_code_lines("nnx_mnist_single"), _code_lines("nnx_mnist"),
                              lineterm="", n=0)
  changed = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
  assert 0 < len(changed) <= MAX_CHANGED_LINES, "\n".join(changed)


def test_the_example_trains_like_one_device_on_the_whole_batch(topo):
  argv = ["--max-steps", "20", "--batch-size", str(8 * topo.replica_count)]
  single = _load("nnx_mnist_single").main(argv)["step_loss"]
  try:
    mine = _load("nnx_mnist").main(argv)["step_loss"]
  finally:
    jax.set_mesh(None)  # the example sets the mesh for the whole process
  # The step returns the loss reduced over every replica: one device's, on every rank.
  assert len(single) == len(mine) == 20
  np.testing.assert_allclose(mine, single, rtol=1e-5)
  everyone = host.allgather_object(mine)
  assert all(theirs == mine for theirs in everyone), everyone
  assert single[-1] < single[0]
