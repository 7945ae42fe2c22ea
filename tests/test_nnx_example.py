"""Flax's NNX MNIST tutorial made data-parallel in at most 10 lines, in both styles.

examples/nnx_mnist.py (jit over global arrays) and
examples/nnx_mnist_data_parallel.py (per replica, `jdist.nnx_data_parallel`)
must train like their single-device original (examples/nnx_mnist_single.py)
on the same global batches: the per-step losses agree to 1e-5 relative for
20 steps in every topology (1x4, 2x1, 2x2).
"""

import difflib
import importlib.util
import os

import jax
import numpy as np
import pytest

import jdist
from jdist.runtime import host
from tests import launch

EXAMPLES = os.path.join(launch.REPO, "examples")
MAX_CHANGED_LINES = 10
PORTS = ["nnx_mnist", "nnx_mnist_data_parallel"]


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


@pytest.mark.parametrize("port", PORTS)
def test_the_data_parallel_example_changes_at_most_ten_lines(port):
  diff = difflib.unified_diff(_code_lines("nnx_mnist_single"), _code_lines(port),
                              lineterm="", n=0)
  changed = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
  assert 0 < len(changed) <= MAX_CHANGED_LINES, "\n".join(changed)


@pytest.mark.parametrize("port", PORTS)
def test_the_example_trains_like_one_device_on_the_whole_batch(topo, port):
  argv = ["--max-steps", "20", "--batch-size", str(8 * topo.replica_count)]
  single = _load("nnx_mnist_single").main(argv)["step_loss"]
  try:
    mine = _load(port).main(argv)["step_loss"]
  finally:
    jax.set_mesh(None)  # the example sets the mesh for the whole process
  # The step returns the loss reduced over every replica: one device's, on every rank.
  assert len(single) == len(mine) == 20
  np.testing.assert_allclose(mine, single, rtol=1e-5)
  everyone = host.allgather_object(mine)
  assert all(theirs == mine for theirs in everyone), everyone
  assert single[-1] < single[0]


def test_the_data_parallel_port_logs_epoch_metrics_like_one_device(topo):
  """Its metrics, a copy per replica averaged by jdist.replica_mean, are one device's."""
  argv = ["--epochs", "1", "--batch-size", str(8 * topo.replica_count)]
  single = _load("nnx_mnist_single").main(argv)
  mine = _load("nnx_mnist_data_parallel").main(argv)
  for key in ("train_loss", "train_accuracy", "test_loss", "test_accuracy"):
    np.testing.assert_allclose(mine[key], single[key], rtol=2e-4, err_msg=key)
