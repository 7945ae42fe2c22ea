"""The chaos benchmark's bookkeeping (benchmarks/sections/elastic_chaos/checkpoints.py, elastic_chaos.py).

No rig here: the schedule is rebuilt from a recorded log fed line by line,
and checkpoints of both tiers are written by this process's own jdist and
compared as the benchmark compares the chaos run's with the replay's.
"""

import os
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from benchmarks.sections.elastic_chaos import checkpoints as chaos_checkpoints
from benchmarks.sections.elastic_chaos import run as elastic_chaos
from jdist.app import checkpoint_tiers
from jdist.runtime import host

# A recorded chaos log, shortened: the launcher announces "from step 16" for its grow-back,
# but the job saved once more before the stop reached it and resumed from 24; the run
# after a lost host resumed from node A's local step 28, newer than its persistent 24.
LOG = """\
jdist train: cnn (131,080 parameters) on digits; process 0/2 on 2 nodes x 1 local devices
no checkpoint in /c/chaos yet: starting from scratch
checkpoint saved at step 8
checkpoint saved at step 16
jdist launch: the job failed: lost host nodeB (ranks 1).
jdist launch: restart 1: lost host nodeB (ranks 1); continuing on 1 of 2 processes
jdist train: cnn (131,080 parameters) on digits; process 0/1 x 1 local devices = 1 replicas
resumed from /c/chaos step 16 (epoch 2, batch 0/16)
jdist launch: host nodeB is back: stopping the job at its next checkpoint to continue on 2
checkpoint saved at step 24
jdist launch: restart 2: host nodeB is back; continuing on 2 of 2 processes from step 16
jdist train: cnn (131,080 parameters) on digits; process 0/2 on 2 nodes x 1 local devices
resumed from /c/chaos step 24 (epoch 2, batch 8/16)
jdist launch: restart 3: lost host nodeB (ranks 1); continuing on 1 of 2 processes
jdist train: cnn (131,080 parameters) on digits; process 0/1 x 1 local devices = 1 replicas
resumed from /dev/shm/jdist-local/nodeA-0123456789ab step 28 (epoch 2, batch 12/16)
"""


def test_schedule_follows_the_resumed_lines_not_the_launchers_announcement():
  chaos = elastic_chaos.Chaos(rig=None, args=None)
  for line in LOG.splitlines(keepends=True):
    chaos.take(line)
  assert elastic_chaos.schedule_of(chaos.runs) == [(0, 2, 16), (16, 1, 24), (24, 2, 28),
                                                   (28, 1, None)]
  assert [run["tier"] for run in chaos.runs] == [None, "persistent", "persistent", "local"]
  assert chaos.grows == 1
  assert elastic_chaos.resumed_step("x\nresumed from /r step 40 (epoch 3)\n") == 40
  assert elastic_chaos.resumed_step("no checkpoint in /r yet: starting from scratch") == 0
  assert elastic_chaos.resumed_step("jdist train: error") is None


def test_segment_of_a_step():
  schedule = [(0, 2, 16), (16, 1, 24), (24, 2, None)]
  assert [chaos_checkpoints.segment_of(schedule, s) for s in (8, 16, 17, 24, 100)] == [
      0, 0, 1, 1, 2]
  assert chaos_checkpoints.segment_of(schedule, 0) is None


@pytest.fixture
def shared_dir():
  """One directory for every process (rank 0 writes checkpoints; every process copies)."""
  path = tempfile.mkdtemp(prefix="jdist_chaos_") if jdist.init().is_primary else None
  path = host.allgather_object(path)[0]
  yield path
  host.allgather_object(None)  # nobody still reading
  if jdist.init().is_primary:
    shutil.rmtree(path, ignore_errors=True)


def _written():
  """Waits for rank 0, the writer: a save can return on the others before its files are renamed
  into place, and an archive looking then would miss a checkpoint that is deleted next."""
  host.barrier("checkpoint written")


def _scan(archive):
  """Copies what rank 0 wrote, then waits for every process's copy: the next save or
  `drop_after` on rank 0 deletes steps another process's archive may still be copying."""
  archive.scan()
  host.barrier("checkpoints archived")


def _state(scale):
  return {"params": jdist.replicate({"w": jnp.arange(6.0).reshape(2, 3) * scale,
                                     "b": jnp.ones(3)})}


def test_both_tiers_read_alike_and_the_first_step_over_tolerance_is_found(tmp_path, shared_dir):
  chaos_dir, replay_dir = (os.path.join(shared_dir, n) for n in ("chaos", "replay"))
  local_dir = os.path.join(shared_dir, "local")
  archive = chaos_checkpoints.Archive(str(tmp_path / "archive"), {
      "chaos": chaos_dir, "chaos_local": local_dir, "replay": replay_dir})
  chaos = jdist.CheckpointManager(chaos_dir, keep=1)
  local = checkpoint_tiers.LocalManager(local_dir, keep=1)
  replay = jdist.CheckpointManager(replay_dir, keep=1)
  # Equal at 8 (persistent) and 12 (local vs the replay's persistent), off by 1e-3 from 16.
  for step, scale, theirs in ((8, 1.0, 1.0), (12, 2.0, 2.0), (16, 3.0, 3.001), (24, 4.0, 4.1)):
    (local if step == 12 else chaos).save(step, _state(scale),
                                          metadata={"epoch": 1, "batch_in_epoch": step % 16})
    replay.save(step, _state(theirs), metadata={"epoch": 1, "batch_in_epoch": step % 16})
    _written()
    _scan(archive)  # keep=1: each step is gone by the next save, but copied
  archive.scan()
  assert sorted(archive.copies("chaos")) == [8, 16, 24]
  assert sorted(archive.copies("chaos_local")) == [12]
  assert not os.path.exists(os.path.join(chaos_dir, "8"))
  record, arrays = chaos_checkpoints.read_checkpoint(archive.copies("chaos_local")[12][0])
  assert record["step"] == 12
  np.testing.assert_array_equal(arrays["['params']['w']"], np.arange(6.0).reshape(2, 3) * 2)

  result = chaos_checkpoints.compare(archive.copies("chaos", "chaos_local"), archive.copies("replay"),
                                     [(0, 2, 12), (12, 1, 24)], tolerance=1e-5)
  steps = dict(result["steps"])
  assert steps[8] == 0.0 and steps[12] == 0.0
  np.testing.assert_allclose(steps[16], 0.005, rtol=1e-3)  # 5 x 0.001, on w[1, 2]
  first = result["first_over"]
  assert (first["step"], first["leaf"], first["segment"]) == (16, "['params']['w']", 1)
  assert first["segment_details"] == [12, 1, 24] and first["position"] == [1, 0]
  assert result["superseded"] == [] and result["unreadable"] == []


def test_a_step_saved_again_is_a_new_version(tmp_path, shared_dir):
  directory = os.path.join(shared_dir, "ckpt")
  archive = chaos_checkpoints.Archive(str(tmp_path / "archive"), {"chaos": directory})
  manager = checkpoint_tiers.LocalManager(directory, keep=2)
  manager.save(4, _state(1.0))
  _written()
  _scan(archive)
  _scan(archive)  # seen: not copied twice
  manager.drop_after(None)
  manager.save(4, _state(5.0))  # a resume from an older step saved 4 again
  _written()
  _scan(archive)
  (first, second), = archive.copies("chaos").values()
  assert first.endswith("4-0") and second.endswith("4-1")  # the newer save last
  gap, _ = chaos_checkpoints.difference(chaos_checkpoints.read_checkpoint(first)[1],
                                        chaos_checkpoints.read_checkpoint(second)[1])
  assert gap == 20.0
  # Against a replay that went through the newer save: that one is the trajectory's.
  replay_dir = os.path.join(shared_dir, "replay")
  checkpoint_tiers.LocalManager(replay_dir).save(4, _state(5.0))
  _written()
  archive.sources["replay"] = replay_dir
  archive.scan()
  result = chaos_checkpoints.compare(archive.copies("chaos"), archive.copies("replay"),
                                     [(0, 1, None)], tolerance=1e-5)
  assert result["steps"] == [[4, 0.0]] and result["first_over"] is None
  assert result["superseded"] == [[4, 20.0]]
