"""`jdist launch --shrink`: a rank dies and the others train on (Open MPI ULFM).

Launches its own mpirun and kills one of its ranks: it runs in the plain
pytest session only (scripts/test.sh leaves test_fault_* out of MPI runs).
Also checks the pieces that need no MPI: the batch split that keeps the
global batch, and the flags the mode refuses.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jdist.app import datasets
from jdist.app import launch_shrink
from jdist.app import shrink_checkpoints
from jdist.app import train_shrink
from jdist.app.config import TrainConfig
from jdist.collectives import shrinkable
from tests import launch

JOB = os.path.join(launch.REPO, "tests", "jobs", "shrink_faults.py")
# Rank 2 dies before step 12: the survivors go back to the last step they agreed on.
AGREED = 12 // train_shrink.CONFIRM_EVERY * train_shrink.CONFIRM_EVERY
MAIN_JOB = ["--model", "cnn", "--dataset", "digits", "--batch-size", "16", "--lr", "0.05",
            "--momentum", "0.9"]


@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
def test_replica_slices_cover_the_global_batch_once(replicas):
  batch = np.arange(100, 148)
  taken = []
  for replica in range(replicas):
    chunks, weights = train_shrink.replica_slice(batch, replica, replicas, 16)
    assert chunks.shape[1] == 16 and weights.shape == chunks.shape  # one compiled shape
    taken.extend(chunks[weights > 0].tolist())
  assert sorted(taken) == batch.tolist()


def test_shrink_mode_refuses_what_it_would_ignore():
  with pytest.raises(train_shrink.ShrinkModeError, match="--half"):
    train_shrink.check_config(TrainConfig(half="bf16"))
  with pytest.raises(train_shrink.ShrinkModeError, match="--cpu-devices"):
    train_shrink.check_config(TrainConfig(cpu_devices=2))
  train_shrink.check_config(TrainConfig(lr=0.05, momentum=0.9, batch_size=16))


def _kill_job(marker: str) -> None:
  """SIGKILLs the processes whose command line holds `marker` (this test's job)."""
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        if marker.encode() in cmdline.read():
          os.kill(int(pid), signal.SIGKILL)
    except OSError:
      pass


def _launch_shrink_job(log, processes, job, train_flags, launch_flags=(), **env):
  """`jdist launch --shrink -np PROCESSES` of `shrink_faults.py JOB -- MAIN_JOB TRAIN_FLAGS`."""
  if launch.under_mpirun():
    pytest.skip("launches its own mpirun")
  argv = [sys.executable, "-m", "jdist.app.cli", "launch", "--shrink", "-np", str(processes),
          *launch_flags, "--mpirun", launch.mpirun_binary(), "--mpirun-args=--oversubscribe",
          "--", sys.executable, JOB, *job, "--", *MAIN_JOB, *train_flags, "--log-file", str(log)]
  try:
    # --shrink moves data over TCP: on one host, over the loopback only, not a
    # rig's bridge that a test beside this one builds and removes meanwhile.
    env = launch.clean_env(OMPI_MCA_btl_tcp_if_include="lo", **env)
    result = launch.run_own_session(argv, env, timeout=400)
  except subprocess.TimeoutExpired as err:
    _kill_job(str(log))  # mpirun runs in a session of the launcher's own
    pytest.fail(f"the shrink job hung: {err}")
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  return [json.loads(line) for line in log.read_text().splitlines()], output


def _digests(log) -> dict[str, str]:
  """{launch rank: final parameter digest} that each survivor of the job wrote beside `log`."""
  return {path.name.rsplit(".", 1)[1]: path.read_text()
          for path in log.parent.glob(log.name + ".digest.*")}


def _run_shrink_job(tmp_path, *launch_flags, **env):
  """`jdist launch --shrink -np 3` of the digits job where rank 2 dies before step 12."""
  records, output = _launch_shrink_job(tmp_path / "run.jsonl", 3, ["2", "12"], ["--epochs", "2"],
                                       launch_flags, **env)
  shrinks = [r for r in records if r["event"] == "shrink"]
  assert len(shrinks) == 1, output
  event = shrinks[0]
  assert event["lost_ranks"] == [2] and event["lost_hosts"] and event["digests_equal"]
  assert 0 <= event["resumed_at"] - event["detected_at"] <= 10.0, event
  assert records[-1]["event"] == "summary" and records[-1]["test_accuracy"] > 0.85, output
  assert records[-1]["digests_equal"], output  # every replica's final parameters, compared
  # The same, as each survivor wrote it (mpirun may end before it forwards a last line).
  digests = _digests(tmp_path / "run.jsonl")
  assert "0" in digests and "2" not in digests, (digests, output)
  assert len(set(digests.values())) == 1, (digests, output)
  return records, output


def test_fault_rank_killed_survivors_shrink_and_finish(tmp_path):
  records, output = _run_shrink_job(tmp_path)
  assert records[-1]["replicas"] == 2 and records[-1]["grows"] == 0
  assert [r for r in records if r["event"] == "shrink"][0]["replicas"] == 2
  assert f"shrink: resumed at step {AGREED + 1} on 2 replicas" in output, output


def test_fault_rank_killed_job_grows_back_with_the_state_from_memory(tmp_path):
  # Steps on 2 replicas take 0.5 s: the run cannot end before the started
  # process (imports, data, compiling) is ready, however slow the machine.
  records, output = _run_shrink_job(tmp_path, "--max-np", "3",
                                    JDIST_TEST_SLOW_UNTIL_REPLICAS="3")
  grows = [r for r in records if r["event"] == "grow"]
  # rank 3: started in rank 2's place
  assert len(grows) == 1 and grows[0]["new_ranks"] == [3] and grows[0]["replicas"] == 3, output
  # The survivors trained on while it started, and took it in once it was ready.
  assert f"shrink: resumed at step {AGREED + 1} on 2 replicas" in output, output
  assert grows[0]["step"] > AGREED + 1, grows
  assert grows[0]["started_at"] < grows[0]["ready_at"] <= grows[0]["joined_at"], grows
  assert grows[0]["digests_equal"], grows  # the new process holds the survivors' state
  assert records[-1]["replicas"] == 3 and records[-1]["grows"] == 1
  # Every epoch is logged once, by whichever process is rank 0.
  assert [r["epoch"] for r in records if r["event"] == "epoch"] == [1, 2]


def test_launch_shrink_checks_its_process_counts(capsys):
  from jdist.app import launch as launch_cli  # pylint: disable=import-outside-toplevel
  for flags, message in ((["--max-np", "2"], "--max-np 2 is below -np 3"),
                         (["--min-np", "0"], "--min-np 0 must be at least 1"),
                         (["--max-np", "4", "--min-np", "5"], "--min-np 5 is above --max-np 4")):
    assert launch_cli.main(["--shrink", "-np", "3", *flags, "--", "true"]) == 2
    assert message in capsys.readouterr().err
  assert launch_cli.main(["--max-np", "4", "-np", "2", "--", "true"]) == 2
  assert "--max-np and --min-np go with --shrink" in capsys.readouterr().err


def test_launch_shrink_refuses_an_mpi_without_ulfm(tmp_path):
  fake = tmp_path / "ompi_info"
  fake.write_text("#!/bin/sh\necho '  Fault Tolerance support: no'\n")
  fake.chmod(0o755)
  missing = launch_shrink.ulfm_missing(str(tmp_path / "mpirun"))
  assert "does not report 'Fault Tolerance support: yes'" in missing and "--max-restarts" in missing
  assert "could not run" in launch_shrink.ulfm_missing(str(tmp_path / "elsewhere" / "mpirun"))
  done = subprocess.run([sys.executable, "-m", "jdist.app.cli", "launch", "--shrink", "-np", "2",
                         "--mpirun", str(tmp_path / "mpirun"), "--", "true"],
                        capture_output=True, text=True, timeout=120, env=launch.clean_env())
  assert done.returncode == 2 and "jdist launch --shrink:" in done.stderr, done.stderr[-2000:]
  # The MPI the tests use has it (CI must run the shrink fault test).
  launch.require([m for m in [launch_shrink.ulfm_missing(launch.mpirun_binary())] if m], "ULFM")


def test_launch_shrink_adds_ulfm_and_tcp():
  assert launch_shrink.ULFM_MPIRUN_ARGS[:2] == ("--with-ft", "ulfm")
  assert "tcp,self" in launch_shrink.ULFM_MPIRUN_ARGS
  assert "^han" in launch_shrink.ULFM_MPIRUN_ARGS  # HAN crashed on a grown job across nodes
  assert launch_shrink.SHRINK_ENV["JDIST_JAX_DISTRIBUTED"] == "0"


def test_fault_a_process_that_dies_while_starting_costs_the_survivors_no_step(tmp_path):
  # Rank 2 dies at step 12; the survivors start a process in its place, which
  # dies before it says it is ready (MPI never reports it). The survivors
  # train on without it, to the end; nothing waits for it (it once kept them
  # in the merge until --timeout, and the job was restarted).
  hostfile = tmp_path / "hosts"
  hostfile.write_text("localhost slots=3\n")
  flags = ["--epochs", "2", "--train-limit", "480", "--test-limit", "120", "--timeout", "25"]
  records, output = _launch_shrink_job(
      tmp_path / "run.jsonl", 3, ["2", "12"], flags,
      ["--max-np", "3", "--hostfile", str(hostfile)], JDIST_TEST_JOINER_DIES="1")
  assert "a started process dies before joining" in output, output[-4000:]
  assert "waited over" not in output and "restart" not in output, output[-4000:]
  summary = records[-1]  # 480 examples, global batch 48: 10 steps an epoch
  assert summary["event"] == "summary" and summary["steps"] == 20, records
  assert summary["replicas"] == 2 and summary["grows"] == 0 and summary["shrinks"] == 1
  assert summary["digests_equal"], summary


def test_the_stall_guard_speaks_up_only_for_a_wait_past_its_deadline():
  stalls = []
  guard = shrinkable.StallGuard(0.4, on_stall=stalls.append)
  for _ in range(3):
    with guard.waiting("Allreduce"):  # quick calls, one after another
      time.sleep(0.1)
  time.sleep(0.5)
  assert not stalls
  with guard.waiting("Merge"):
    time.sleep(1.2)
  assert len(stalls) == 1 and "waited over 0.4 s in Merge" in stalls[0]
  idle = shrinkable.StallGuard(None, on_stall=stalls.append)  # no deadline: no watch
  with idle.waiting("Merge"):
    time.sleep(0.1)
  assert idle._thread is None  # pylint: disable=protected-access


def test_an_mpi_start_that_never_ends_ends_the_process_past_the_deadline(tmp_path):
  # MPI_Init runs inside mpi4py's import, holding the GIL: a stand-in
  # module that computes forever in C does the same.
  (tmp_path / "mpi4py").mkdir()
  (tmp_path / "mpi4py" / "__init__.py").write_text("")
  (tmp_path / "mpi4py" / "MPI.py").write_text("sum(range(10 ** 15))\n")
  code = ("from jdist.collectives import shrinkable\n"
          "shrinkable.STALLS.deadline_s = 1.0\n"
          "shrinkable.spawned()\n")
  started = time.monotonic()
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env=dict(launch.clean_env(), PYTHONPATH=os.pathsep.join(
                            [str(tmp_path), launch.REPO])))
  assert done.returncode == 1 and time.monotonic() - started < 60, done.stderr[-2000:]
  assert "Timeout" in done.stderr and "in spawned" in done.stderr, done.stderr[-2000:]


def test_shrink_flags_parse():
  from jdist.app import cli  # pylint: disable=import-outside-toplevel
  config, _ = cli.parse_train_args(["--shrink", "--lr", "0.05"])
  assert config == TrainConfig(lr=0.05)


def test_fault_free_shrink_run_resumed_mid_epoch_ends_bit_identical(tmp_path):
  # What `jdist launch --shrink --max-restarts` starts after a lost node: the
  # same command with --resume, from the live rank 0's last checkpoint.
  flags = ["--epochs", "2", "--train-limit", "512", "--test-limit", "128",
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "8"]
  whole, output = _launch_shrink_job(tmp_path / "whole.jsonl", 2, ["9", "0"], flags)
  # 512 examples, global batch 32: 16 steps an epoch; saved at 8, 16, 24 and
  # 32, of which the newest 3 are kept.
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["16", "24", "32"], output
  digest = _digests(tmp_path / "whole.jsonl")["0"]
  shutil.rmtree(tmp_path / "ckpt" / "32")  # as if the job ended during step 25-32
  resumed, output = _launch_shrink_job(tmp_path / "resumed.jsonl", 2, ["9", "0"],
                                       flags + ["--resume"])
  assert "jdist train --shrink: resumed from step 24 of" in output, output
  assert _digests(tmp_path / "resumed.jsonl")["0"] == digest, output
  epochs = [r for r in resumed if r["event"] == "epoch"]
  assert [r["epoch"] for r in epochs] == [2]  # epoch 2's first 8 steps' tallies came back
  assert epochs[0]["train_loss"] == [r for r in whole if r["event"] == "epoch"][1]["train_loss"]
  assert resumed[-1]["params_digest"] == whole[-1]["params_digest"]
  with pytest.raises(train_shrink.ShrinkModeError, match="already holds checkpoints"):
    train_shrink.resume_point(TrainConfig(checkpoint_dir=str(tmp_path / "ckpt")),
                              shrink_checkpoints.ShrinkCheckpoints(str(tmp_path / "ckpt")),
                              _OneProcess())


class _OneProcess:
  rank = 0

  @staticmethod
  def bcast_object(value):
    return value


def _kill_node_after_epoch(rig, log, node: int, epoch: int, stop: threading.Event) -> None:
  """Kills rig node `node` a second after `log` records epoch `epoch` (or never, once `stop`)."""
  while not stop.wait(0.2):
    with contextlib.suppress(OSError, ValueError):
      records = [json.loads(line) for line in log.read_text().splitlines()]
      if any(r["event"] == "epoch" and r["epoch"] == epoch for r in records):
        time.sleep(1.0)
        rig.kill_node(node)
        return


def _run_rig_shrink_then_lost_node(log) -> subprocess.CompletedProcess:
  """One run of the scenario below on a fresh rig; `log` is its JSON log."""
  from benchmarks.harness import cluster  # pylint: disable=import-outside-toplevel
  job = [sys.executable, JOB, "0", "6", "0.05", "--", *MAIN_JOB, "--epochs", "3", "--train-limit",
         "1280", "--log-file", str(log), "--checkpoint-dir", str(log.parent / "ckpt"),
         "--checkpoint-every", "4", "--resume"]
  stop = threading.Event()
  with cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
    argv = rig.launch_argv(job, 2, ["--shrink", "-np", "4", "--mpirun-args", "--map-by slot",
                                    "--max-restarts", "1"])
    killer = threading.Thread(target=_kill_node_after_epoch, args=(rig, log, 1, 1, stop))
    killer.start()
    try:
      return launch.run_own_session(argv, rig.launch_env(launch.clean_env()), timeout=300)
    except subprocess.TimeoutExpired as err:
      pytest.fail(f"the job hung on the rig: {err}")
    finally:
      stop.set()
      killer.join()


@pytest.mark.timeout(600)  # a second run, after PRRTE lost a daemon in the first
def test_fault_rig_shrink_past_rank_0_then_restart_past_a_lost_node(rig_ready, tmp_path):
  """The rig's 2 nodes x 2 processes under `jdist launch --shrink --max-restarts 1`.

  Launch rank 0 (node A) SIGKILLs itself 0.05 s into step 6 (in its gradient
  or in the allreduce): the 3 others shrink past it. The rig's nodes have
  their own hostnames, so the survivors' exchange crosses a 1 Gbit/s link
  and the lost host is named. An allreduce cut short there returned
  different sums to the survivors before `ShrinkableComm.confirm` (their
  digests then differed). A second into epoch 2, node B is killed:
  PRRTE 3.0 ends the job when it loses a node's daemon (docs/multinode.md),
  and the launcher starts it again on node A from the checkpoint that the
  live rank 0 (launch rank 1) wrote at that epoch's end.
  """
  del rig_ready
  if launch.under_mpirun():
    pytest.skip("launches its own mpirun")
  for attempt in (1, 2):
    log = tmp_path / f"try{attempt}" / "run.jsonl"
    log.parent.mkdir()
    result = _run_rig_shrink_then_lost_node(log)
    output = result.stdout + result.stderr
    # PRRTE has lost node B's daemon (it exited 0) before the job shrank past
    # rank 0: node B's ranks then never heard of a death and left past
    # --timeout, and the survivors shrank past them, or past nobody. Seen in
    # three full-suite runs under load (2026-12-01, twice 2026-12-02: once
    # before any fault, once with epoch 1 done on 4 replicas), never in 11 runs
    # of this test alone, beside busy loops or beside the watchdog's fault jobs.
    # The scenario did not happen then: once more.
    logged = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    lost_early = (result.returncode != 0 and "A daemon failed to report back" in output
                  and not any(r["event"] == "shrink" and r["lost_ranks"] == [0]
                              for r in logged))
    if not lost_early:
      break
    print(f"attempt {attempt}: PRRTE lost node B's daemon before the faults:\n{output[-3000:]}")
  assert result.returncode == 0, output[-4000:]
  records = [json.loads(line) for line in log.read_text().splitlines()]
  shrinks = [r for r in records if r["event"] == "shrink"]
  assert shrinks and shrinks[0]["lost_ranks"] == [0], output[-4000:]
  assert shrinks[0]["lost_hosts"] == ["nodeA"] and shrinks[0]["replicas"] == 3
  assert 0 <= shrinks[0]["resumed_at"] - shrinks[0]["detected_at"] <= 10.0, shrinks[0]
  # Node B's ranks may be shrunk past too, in the moment before PRRTE ends the run.
  assert all(set(r["lost_ranks"]) <= {2, 3} for r in shrinks[1:]), shrinks
  assert "jdist launch: restart 1: lost host nodeB (ranks 2, 3)" in output, output[-4000:]
  # 20 steps an epoch; saved at each epoch's end and every agreement >= 4 steps on.
  resumed = re.findall(r"jdist train --shrink: resumed from step (\d+) of", output)
  assert len(resumed) == 1 and 20 <= int(resumed[0]) < 60, output[-4000:]
  assert [r["epoch"] for r in records if r["event"] == "epoch"] == [1, 2, 3]  # each once
  summary = records[-1]
  assert summary["event"] == "summary" and summary["steps"] == 60, summary  # 3 x 1280 / 64
  assert summary["replicas"] == 2  # node A's two slots
  digests = _digests(log)  # the second run's survivors overwrite the first run's
  assert sorted(digests) == ["0", "1"], output[-4000:]
  assert len(set(digests.values())) == 1, output[-4000:]  # replicas bit-identical


def test_subprocess_shrink_section_quick_cost_runs_ulfm_on_and_off(tmp_path):
  """`python -m benchmarks shrink --quick --parts cost`: ULFM on and off, one round."""
  if launch.under_mpirun():
    pytest.skip("launches its own mpirun")
  done = subprocess.run([sys.executable, "-m", "benchmarks", "shrink", "--quick", "--parts",
                         "cost", "--out", str(tmp_path)], cwd=launch.REPO, capture_output=True,
                        text=True, timeout=180, env=launch.clean_env())
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
  results = json.loads((tmp_path / "shrink.json").read_text())
  assert {r["config"] for r in results["cost"]["shm"]} == {"ulfm", "tcp", "default"}
  assert all(r["processes"] == 2 and r["step_s"] > 0 for r in results["cost"]["shm"])
  assert "ulfm/tcp" in (tmp_path / "shrink.md").read_text()


def test_launch_shrink_names_a_lost_node_as_beyond_shrink(tmp_path):
  """PRRTE's lost-daemon report under --shrink: exit 1, and why --shrink could not go on."""
  (tmp_path / "ompi_info").write_text("#!/bin/sh\necho '  Fault Tolerance support: yes'\n")
  (tmp_path / "mpirun").write_text(
      "#!/bin/sh\necho 'PRTE has lost communication with a remote daemon.'\n"
      "echo '  Remote daemon: [prterun-vm-1@0,2] on node nodeB'\nexit 0\n")
  for name in ("ompi_info", "mpirun"):
    (tmp_path / name).chmod(0o755)
  done = subprocess.run([sys.executable, "-m", "jdist.app.cli", "launch", "--shrink", "-np", "2",
                         "--mpirun", str(tmp_path / "mpirun"), "--", "true"],
                        capture_output=True, text=True, timeout=120, env=launch.clean_env())
  assert done.returncode == 1, done.stderr[-2000:]
  assert "lost host nodeB" in done.stderr and "mpirun lost the daemon of nodeB" in done.stderr
  assert "--max-restarts" in done.stderr, done.stderr[-2000:]


class _OneComm:
  """A one-process stand-in for ShrinkableComm whose `confirm` fails at the calls named."""

  def __init__(self, fail_at):
    self.rank, self.size, self.launch_rank, self.calls = 0, 1, 0, 0
    self.fail_at = set(fail_at)

  def sum(self, array):
    return np.array(array, copy=True)

  minimum = bcast = sum

  def confirm(self):
    self.calls += 1
    if self.calls in self.fail_at:
      raise shrinkable.PeerLost(f"confirm {self.calls}")

  def shrink(self):
    return shrinkable.Shrunk((1,), ("ghost",), 1)

  def allgather_object(self, value):
    return [value]


class _NoGrowthComm(_OneComm):
  """A one-process job under `--max-np 2` where no process can be started."""
  members, hosts = (0,), {0: "h"}

  def __init__(self):
    super().__init__(fail_at=())
    self.grow_tries = []

  def start_growth(self, count, command, hosts=()):
    self.grow_tries.append(count)
    raise shrinkable.GrowFailed("no free slot")


class _NeverReadyComm(_NoGrowthComm):
  """A one-process job under `--max-np 2` whose started process never gets ready."""

  def start_growth(self, count, command, hosts=()):
    self.grow_tries.append(count)
    return shrinkable.Starting(None, count, time.monotonic(), set())

  def growth_verdict(self, starting, give_up):
    self.verdicts = getattr(self, "verdicts", 0) + 1
    return shrinkable.GIVE_UP if give_up else shrinkable.WAIT


def _tiny_data():
  rng = np.random.default_rng(0)
  return datasets.Dataset(rng.random((64, 8, 8, 1), np.float32), rng.integers(0, 10, 64),
                          rng.random((20, 8, 8, 1), np.float32), rng.integers(0, 10, 20),
                          10, "synthetic")


def test_a_failed_growth_is_tried_again_at_the_next_epoch_not_every_step(capsys):
  config = TrainConfig(model="cnn", batch_size=16, epochs=3, lr=0.05)
  comm = _NoGrowthComm()
  run = train_shrink.ShrinkRun(config, _tiny_data(), comm, growth=train_shrink.Growth(1, 2, ()))
  summary = run.run()  # 4 steps an epoch: tries before steps 0, 4 and 8
  assert comm.grow_tries == [1, 1, 1] and summary["steps"] == 12 and summary["replicas"] == 1
  assert "no free slot; going on with 1 replicas (trying again at step 4)" in capsys.readouterr().out


def test_started_processes_never_ready_are_given_up_on_while_the_job_trains(capsys):
  config = TrainConfig(model="cnn", batch_size=16, epochs=3, lr=0.05)
  comm = _NeverReadyComm()
  run = train_shrink.ShrinkRun(config, _tiny_data(), comm, growth=train_shrink.Growth(1, 2, ()))
  run.grow_wait_s = 0.0  # past the wait at the first verdict
  summary = run.run()  # 12 steps: before each, others are started and given up on
  assert comm.grow_tries == [1] * 12 and comm.verdicts == 12
  assert summary["steps"] == 12 and summary["replicas"] == 1 and summary["grows"] == 0
  assert capsys.readouterr().out.count("were not ready within 0 s (one may have died while "
                                       "starting); starting others") == 12


def test_an_evaluation_cut_short_is_retaken_and_every_epoch_logged_once(tmp_path):
  """A loss during epoch 1's evaluation and during the final one: shrunk past, logged once."""
  data = _tiny_data()
  log = tmp_path / "run.jsonl"
  config = TrainConfig(model="cnn", batch_size=16, epochs=2, lr=0.05, log_file=str(log))
  # 4 steps an epoch, an agreement at each epoch's end: confirm calls are step 4 (1),
  # epoch 1's evaluation (2), step 8 (3), epoch 2's (4), the final evaluation (5).
  summary = train_shrink.ShrinkRun(config, data, _OneComm(fail_at=(2, 5))).run()
  records = [json.loads(line) for line in log.read_text().splitlines()]
  assert [r["epoch"] for r in records if r["event"] == "epoch"] == [1, 2]
  assert [r["step"] for r in records if r["event"] == "shrink"] == [4, 8]
  assert summary["steps"] == 8 and summary["shrinks"] == 2 and records[-1] == summary
  assert all(r["digests_equal"] for r in records if r["event"] == "shrink")
