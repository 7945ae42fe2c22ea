"""`jdist train --local-checkpoint-every`: the local tier beside the persistent one.

Every rank runs each test (under mpirun too). A run of 2 epochs x 4 steps
saves its persistent checkpoints at the epoch ends (steps 4, 8) and its
local ones every 3 steps (3, 6); deleting persistent step 8 leaves the
state of a job that died after step 6. Each resume must finish bit for bit
as the uninterrupted run did (same topology), from the newest checkpoint
that every process can read intact; a damaged one is set aside.
"""

import os
import shutil

import jax
import numpy as np
import pytest

import jdist
from jdist.app import checkpoint_tiers as tiers
from jdist.app.config import ConfigError
from jdist.app.config import TrainConfig
from jdist.app.train import train
from jdist.runtime import host
from tests.test_train import _config
from tests.test_train import shared_dir  # pylint: disable=unused-import


def _on_rank0(fn) -> None:
  if jdist.init().is_primary:
    fn()
  host.barrier()


def _interrupted(topo, directory: str, local_dir: str):
  """The uninterrupted run's summary, and its directories as a job killed after step 6 left them."""
  config = _config(topo, epochs=2, train_limit=256, checkpoint_dir=directory,
                   local_checkpoint_every=3, local_checkpoint_dir=local_dir,
                   check_replicas_every=0)
  whole = train(config, return_state=True)
  assert whole["steps"] == 8
  _on_rank0(lambda: shutil.rmtree(os.path.join(directory, "8")))
  return config, whole


def _resume(config, whole, expected_step):
  resumed = train(TrainConfig(**{**config.to_dict(), "resume": True}), return_state=True)
  assert resumed["resumed_from_step"] == expected_step
  assert resumed["steps"] == whole["steps"]
  for x, y in zip(jax.tree.leaves(whole["state"]), jax.tree.leaves(resumed["state"])):
    np.testing.assert_array_equal(x, y)


def test_resume_takes_the_newest_intact_checkpoint_of_both_tiers(topo, shared_dir):
  directory, local_dir = (os.path.join(shared_dir, d) for d in ("ckpt", "local"))
  config, whole = _interrupted(topo, directory, local_dir)
  assert sorted(os.listdir(local_dir)) == ["3", "6"]  # every 3 steps, the 2 newest kept
  _resume(config, whole, expected_step=6)

  def damage():  # the same job killed after step 6 again, its local step 6 damaged
    shutil.rmtree(os.path.join(directory, "8"))
    arrays = os.path.join(local_dir, "6", "arrays.npz")
    with open(arrays, "r+b") as stream:  # truncated, as by a full disk
      stream.truncate(os.path.getsize(arrays) // 2)
    # A writer killed midway: its partial directory, with a newer step, is never read.
    shutil.copytree(os.path.join(local_dir, "3"), os.path.join(local_dir, "7.partial-1"))

  _on_rank0(damage)
  # Local 6 cannot be read (set aside), local 3 is older than persistent 4.
  _resume(config, whole, expected_step=4)
  assert "6.corrupt" in os.listdir(local_dir)


def test_a_host_without_the_local_save_falls_back_to_the_persistent_tier(
    topo, shared_dir, monkeypatch):
  if topo.process_count == 1:
    pytest.skip("needs processes with local directories of their own (under mpirun)")
  directory = os.path.join(shared_dir, "ckpt")
  # The default directory, one per process here as one per node on a cluster:
  # rank 0 writes the local tier into its own, the others' stay empty.
  monkeypatch.setattr(tiers, "default_local_dir",
                      lambda _: os.path.join(shared_dir, f"local-{topo.process_index}"))
  config, whole = _interrupted(topo, directory, None)
  assert sorted(os.listdir(os.path.join(shared_dir, "local-0"))) == ["3", "6"]
  _resume(config, whole, expected_step=4)


def test_default_local_dir_is_per_node_and_per_run(tmp_path):
  first = tiers.default_local_dir(str(tmp_path / "a"))
  assert first != tiers.default_local_dir(str(tmp_path / "b"))
  assert os.uname().nodename in os.path.basename(first)
  assert tiers.resume_order([4, 8], [6, 8]) == [(8, tiers.PERSISTENT), (8, tiers.LOCAL),
                                                (6, tiers.LOCAL), (4, tiers.PERSISTENT)]


def test_local_flags_need_a_persistent_directory(topo):
  with pytest.raises(ConfigError, match="--local-checkpoint-every needs --checkpoint-dir"):
    train(_config(topo, local_checkpoint_every=5))
  with pytest.raises(ConfigError, match="--local-checkpoint-dir needs --local-checkpoint-every"):
    train(_config(topo, checkpoint_dir="x", local_checkpoint_dir="y"))
  with pytest.raises(ConfigError, match="local_checkpoint_every"):
    train(_config(topo, checkpoint_dir="x", local_checkpoint_every=-1))
