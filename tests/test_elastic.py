"""Elastic restarts (jdist/app/elastic.py and `jdist launch --max-restarts`).

The hostfile, blacklist, placement and -np rules are checked directly; the
restart loop runs against fake "mpirun" commands (Python scripts that print
what a real job prints on the rig and exit); the real thing, a node's link
taken down mid-run on the namespace rig, is `test_fault_lost_node_restarts_*`
(root only; the plain pytest session runs it).
"""

import argparse
import io
import json
import os
import re
import sys

import pytest

from jdist.app import elastic
from jdist.app import launch
from jdist.app import launch_elastic
from jdist.app import supervise
from jdist.runtime import abort

Host = elastic.Host


def _hostfile(tmp_path, text):
  path = tmp_path / "hosts"
  path.write_text(text)
  return str(path)


def test_read_hostfile_slots_comments_and_errors(tmp_path):
  path = _hostfile(tmp_path,
                   "# rack 1\nnodeA slots=2\n\n10.0.0.2 slots=3 max_slots=4  # b\nnodeC\n")
  assert elastic.read_hostfile(path) == [Host("nodeA", 2), Host("10.0.0.2", 3), Host("nodeC", 1)]
  for text, words in (("nodeA cores=2\n", "cannot read 'cores=2'"),
                      ("nodeA slots=0\n", "slots=0 must be at least 1"),
                      ("nodeA\nnodeA\n", "listed twice"), ("# nothing\n", "names no host")):
    with pytest.raises(elastic.ElasticError, match=words):
      elastic.read_hostfile(_hostfile(tmp_path, text))
  out = elastic.write_hostfile([Host("a", 2), Host("b", 1)], str(tmp_path / "out"))
  assert elastic.read_hostfile(out) == [Host("a", 2), Host("b", 1)]


def test_blacklist_leaves_a_host_out_until_its_cooldown_ends():
  now = [100.0]
  blacklist = elastic.Blacklist(cooldown=60, clock=lambda: now[0])
  hosts = [Host("a", 2), Host("b", 2), Host("c", 2)]
  blacklist.add("b")
  assert blacklist.healthy(hosts) == [Host("a", 2), Host("c", 2)]
  now[0] = 159.0
  assert blacklist.blocked() == ["b"]
  now[0] = 160.0  # cooldown over: tried again at the next restart
  assert blacklist.healthy(hosts) == hosts and blacklist.blocked() == []
  blacklist.add("b")  # lost again: out for another cooldown
  assert blacklist.blocked() == ["b"]


def test_placement_and_lost_entries_map_host_names_to_hostfile_lines():
  hosts = [Host("10.0.0.1", 2), Host("10.0.0.2", 2)]
  assert elastic.placement(hosts, 3) == ["10.0.0.1", "10.0.0.1", "10.0.0.2"]
  with pytest.raises(elastic.ElasticError, match="5 processes do not fit the 4 slots"):
    elastic.placement(hosts, 5)
  ranks = {0: "nodeA", 1: "nodeA", 2: "nodeB", 3: "nodeB"}
  assert elastic.lost_entries(["nodeB"], ranks, hosts, 4) == ["10.0.0.2"]
  assert elastic.lost_entries(["10.0.0.1"], ranks, hosts, 4) == ["10.0.0.1"]  # named as listed
  # Only the watchdog's silent ranks are known (no rank map): they place the host too.
  assert elastic.lost_entries(["nodeB"], {}, hosts, 4, {"nodeB": [2, 3]}) == ["10.0.0.2"]
  with pytest.raises(elastic.ElasticError, match="cannot tell which hostfile line is the lost "
                                                 "host nodeZ"):
    elastic.lost_entries(["nodeZ"], ranks, hosts, 4)


def test_processes_for_every_slot_or_the_fixed_processes_per_node():
  healthy = [Host("a", 2), Host("c", 4)]
  assert elastic.processes_for(healthy, None, None) == 6  # every healthy slot
  # -np 4 on 2 x 2 slots: 2 per node; one node lost, another healthy: still 4.
  assert elastic.processes_for(healthy, 4, 2) == 4
  assert elastic.processes_for([Host("a", 2)], 4, 2) == 2  # 2 of 4: one node left
  assert elastic.processes_for([Host("a", 1), Host("c", 1)], 3, 1) == 2  # 3 x 1 -> 2 x 1
  assert elastic.used_hosts([Host("a", 2), Host("b", 2), Host("c", 2)], 4) == 2


def test_restart_batch_size_is_left_alone_outside_a_restart(monkeypatch, tmp_path):
  monkeypatch.delenv(elastic.RESTART_ENV, raising=False)
  assert elastic.restart_batch_size(str(tmp_path), 2, 8) == (8, None)
  monkeypatch.setenv(elastic.RESTART_ENV, "1")
  assert elastic.restart_batch_size(None, 2, 8) == (8, None)  # no checkpoints, nothing to keep


def test_restart_batch_size_keeps_the_checkpoints_batch_on_the_same_replicas(monkeypatch,
                                                                             tmp_path):
  # 2 replicas x 16 first, then 1 x 32 (a lost host) saved step 24; the next restart is on
  # 1 replica again: it takes the checkpoint's 32, not the command's (the first run's) 16.
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import jdist  # pylint: disable=g-import-not-at-top
  manager = jdist.CheckpointManager(str(tmp_path), keep=None)
  manager.save(24, {"w": jdist.replicate(jnp.zeros(3))},
               metadata={"replica_count": 1, "config": {"batch_size": 32}})
  monkeypatch.setenv(elastic.RESTART_ENV, "2")
  batch, note = elastic.restart_batch_size(str(tmp_path), 1, 16)
  assert batch == 32 and "1 replicas x batch 32" in note
  assert elastic.restart_batch_size(str(tmp_path), 2, 16) == (16, None)  # 32 / 2: as given
  batch, _ = elastic.restart_batch_size(str(tmp_path), 4, 16)
  assert batch == 8


def _args(hostfile=None, **overrides):
  values = dict(hostfile=hostfile, processes=None, mpirun=sys.executable, mpirun_args="",
                abort_grace=5.0, max_restarts=1, min_nodes=1, cooldown=600.0)
  values.update(overrides)
  return argparse.Namespace(**values)


FAKE_MPIRUN = """\
import json, os, sys, time
args = sys.argv[1:]
hosts = open(args[args.index('--hostfile') + 1]).read().split()
np_ = int(args[args.index('-np') + 1])
state = json.load(open(STATE)) if os.path.exists(STATE) else []
state.append(dict(hosts=hosts, np=np_, restart=os.environ.get('JDIST_RESTART'),
                  ulfm='--with-ft' in args, jax=os.environ.get('JDIST_JAX_DISTRIBUTED'),
                  cache=os.environ.get('JAX_COMPILATION_CACHE_DIR'),
                  forwarded=[args[i + 1] for i, a in enumerate(args) if a == '-x']))
json.dump(state, open(STATE, 'w'))
print(HOSTS_MARKER + ' ' + ' '.join(f'{r}:node{"AB"[r // 2]}' for r in range(np_)), flush=True)
if MODE in ('lose', 'grow') and len(state) == 1:
  sys.stderr.write(LOST)
  sys.exit(0)
if MODE == 'bug':
  sys.exit(3)
if MODE == 'shrunk':  # a rank died, the survivors finished; mpirun reports the dead one
  print(SHRINK_FINISHED + ': 32 steps', flush=True)
  sys.exit(1)
if MODE in ('grow', 'discover') and np_ == 2:  # on fewer hosts: checkpoints until stopped
  for step in (5, 10, 15):
    print(f'checkpoint saved at step {step}', flush=True)
    time.sleep(1.0)
  sys.exit(4)  # not stopped: the test fails on the runs it sees
print('trained', flush=True)
"""


def _elastic_run(tmp_path, monkeypatch, mode, **overrides):
  """Runs the restart loop with a fake mpirun; returns (status, stderr, the runs it saw)."""
  state = str(tmp_path / "runs.json")
  script = tmp_path / "mpirun.py"
  lost = ("PRTE has lost communication with a remote daemon.\n\n"
          "  Remote daemon: [prterun-vm-1@0,2] on node nodeB\n")
  script.write_text(f"STATE = {state!r}\nMODE = {mode!r}\nLOST = {lost!r}\n"
                    f"HOSTS_MARKER = {abort.HOSTS_MARKER!r}\n"
                    f"SHRINK_FINISHED = {supervise.SHRINK_FINISHED!r}\n" + FAKE_MPIRUN)
  hostfile = _hostfile(tmp_path, "10.0.0.1 slots=2\n10.0.0.2 slots=2\n")
  out, err = io.StringIO(), io.StringIO()
  overrides.setdefault("hostfile", hostfile)
  runner = launch_elastic.Elastic([], _args(**overrides), stdout=out, stderr=err)
  # mpirun_argv puts `--hostfile H -np N` right after the "mpirun": run the script there.
  original = supervise.mpirun_argv
  monkeypatch.setattr(supervise, "mpirun_argv", lambda command, **kw: (
      [sys.executable, str(script)] + original(command, **kw)[1:]))
  status = runner.run()
  runs = json.load(open(state)) if os.path.exists(state) else []
  return status, err.getvalue(), runs


def test_parse_discovery_reads_horovod_and_hostfile_lines():
  assert elastic.parse_discovery("a\nb:2\n\n# c\nc slots=3  # rack 2\n") == [
      Host("a", 1), Host("b", 2), Host("c", 3)]
  assert elastic.parse_discovery("") == []  # no host available now
  for text, words in (("a b\n", "line 1: cannot read 'a b'"), ("a:2 slots=3", "cannot read"),
                      ("a\nb:0\n", "line 2: 0 slots"), ("a\na:2\n", "host a is listed twice")):
    with pytest.raises(elastic.ElasticError, match=words):
      elastic.parse_discovery(text)


def test_discover_runs_the_script_and_names_its_failure(tmp_path):
  script = tmp_path / "discover.sh"
  script.write_text("#!/bin/sh\necho nodeA:2\necho nodeB slots=2\n")
  script.chmod(0o755)
  assert elastic.discover(str(script)) == [Host("nodeA", 2), Host("nodeB", 2)]
  script.write_text("#!/bin/sh\necho no hosts file >&2\nexit 2\n")
  with pytest.raises(elastic.ElasticError, match="failed with exit status 2: no hosts file"):
    elastic.discover(str(script))
  with pytest.raises(elastic.ElasticError, match="must be an executable file"):
    elastic.discover(str(tmp_path / "missing.sh"))


def test_grow_to_only_when_the_job_gets_more_processes():
  a, b, c = Host("a", 2), Host("b", 2), Host("c", 1)
  assert elastic.grow_to([a], 2, [a], None, None) is None  # nothing new
  assert elastic.grow_to([a], 2, [a, b], None, None) == ([a, b], 4)  # every slot
  assert elastic.grow_to([a], 2, [a, b], 4, 2) == ([a, b], 4)  # back to the fixed -np
  assert elastic.grow_to([a, b], 4, [a, b, c], 4, 2) is None  # fixed -np already reached
  assert elastic.grow_to([a, b], 4, [b, c], None, None) is None  # 3 slots: fewer
  clock = iter([0.0, 1.0]).__next__
  blacklist = elastic.Blacklist(cooldown=5.0, clock=clock)
  blacklist.add("b")
  assert blacklist.lost_before("b") and not blacklist.lost_before("a")


def test_a_host_back_after_its_cooldown_is_grown_onto_at_the_next_checkpoint(
    tmp_path, monkeypatch):
  # The launch agent is `true`: every host answers the probe.
  status, err, runs = _elastic_run(tmp_path, monkeypatch, "grow", cooldown=0.5,
                                   discovery_interval=0.1,
                                   mpirun_args="--prtemca plm_ssh_agent true")
  assert status == 0, err
  assert "restart 1: lost host nodeB (ranks 2, 3); continuing on 2 of 4 processes" in err
  assert "host nodeB is back: stopping the job at its next checkpoint" in err
  # Stopped at the first checkpoint after node B was seen back.
  assert re.search(r"restart 2: host nodeB is back; continuing on 4 of 4 processes from "
                   r"step (5|10|15)\n", err), err
  assert [(len(r["hosts"]) // 2, r["np"], r["restart"]) for r in runs] == [
      (2, 4, "0"), (1, 2, "1"), (2, 4, "2")]


def test_a_host_the_discovery_script_adds_is_grown_onto(tmp_path, monkeypatch):
  script, count = tmp_path / "discover.sh", tmp_path / "calls"
  # The first call (the start) lists node A only, later ones both.
  script.write_text(f"#!/bin/sh\necho x >> {count}\necho 10.0.0.1:2\n"
                    f"[ $(wc -l < {count}) -gt 1 ] && echo 10.0.0.2:2\nexit 0\n")
  script.chmod(0o755)
  status, err, runs = _elastic_run(tmp_path, monkeypatch, "discover", hostfile=None,
                                   host_discovery=str(script), discovery_interval=0.1)
  assert status == 0, err
  assert re.search(r"restart 1: host 10.0.0.2 is new; continuing on 4 of 2 processes from "
                   r"step (5|10|15)\n", err), err
  assert [(r["hosts"], r["np"]) for r in runs] == [
      (["10.0.0.1", "slots=2"], 2), (["10.0.0.1", "slots=2", "10.0.0.2", "slots=2"], 4)]


def test_a_lost_host_is_left_out_and_the_job_goes_on(tmp_path, monkeypatch):
  status, err, runs = _elastic_run(tmp_path, monkeypatch, "lose")
  assert status == 0, err
  assert ("jdist launch: restart 1: lost host nodeB (ranks 2, 3); continuing on 2 of 4 "
          "processes on 10.0.0.1 slots=2") in err
  assert [(r["hosts"], r["np"], r["restart"]) for r in runs] == [
      (["10.0.0.1", "slots=2", "10.0.0.2", "slots=2"], 4, "0"),
      (["10.0.0.1", "slots=2"], 2, "1")]


def test_every_run_of_a_restarted_job_shares_one_compilation_cache(tmp_path, monkeypatch):
  monkeypatch.delenv(elastic.COMPILE_CACHE_ENV, raising=False)
  status, err, runs = _elastic_run(tmp_path, monkeypatch, "lose")
  assert status == 0, err
  caches = {r["cache"] for r in runs}
  assert len(runs) == 2 and len(caches) == 1 and None not in caches
  assert all(elastic.COMPILE_CACHE_ENV in r["forwarded"] and elastic.RESTART_ENV in r["forwarded"]
             for r in runs)
  monkeypatch.setenv(elastic.COMPILE_CACHE_ENV, str(tmp_path / "mine"))  # the user's: kept
  assert elastic.compile_cache_env(dict(os.environ)) == {
      elastic.COMPILE_CACHE_ENV: str(tmp_path / "mine")}


def test_with_shrink_every_run_is_a_ulfm_run_and_a_lost_node_restarts(tmp_path, monkeypatch):
  status, err, runs = _elastic_run(tmp_path, monkeypatch, "lose", shrink=True, min_np=1,
                                   max_np=0)
  assert status == 0, err
  assert "restart 1: lost host nodeB (ranks 2, 3); continuing on 2 of 4" in err
  assert [(r["np"], r["ulfm"], r["jax"]) for r in runs] == [(4, True, "0"), (2, True, "0")]


def test_with_shrink_a_run_its_survivors_finished_succeeds_without_restart(tmp_path,
                                                                          monkeypatch):
  status, err, runs = _elastic_run(tmp_path, monkeypatch, "shrunk", shrink=True, min_np=1,
                                   max_np=0)
  assert status == 0 and len(runs) == 1, err
  assert "the surviving processes finished the run (mpirun's exit status 1" in err
  (tmp_path / "plain").mkdir()
  status, err, runs = _elastic_run(tmp_path / "plain", monkeypatch, "shrunk", max_restarts=0)
  assert status == 1 and not runs[0]["ulfm"]  # without --shrink: mpirun's status


def test_a_fixed_np_keeps_its_processes_per_node(tmp_path, monkeypatch):
  status, err, runs = _elastic_run(tmp_path, monkeypatch, "lose", processes=4)
  assert status == 0 and [r["np"] for r in runs] == [4, 2], err


def test_below_min_nodes_it_stops_saying_why(tmp_path, monkeypatch):
  status, err, runs = _elastic_run(tmp_path, monkeypatch, "lose", min_nodes=2)
  assert status == launch.EXIT_FAILURE and len(runs) == 1
  assert ("giving up: lost host nodeB (ranks 2, 3); 1 healthy host(s) left (10.0.0.1), "
          "fewer than --min-nodes 2 (left out: 10.0.0.2)") in err


def test_a_failure_without_a_lost_host_counts_against_max_restarts(tmp_path, monkeypatch):
  status, err, runs = _elastic_run(tmp_path, monkeypatch, "bug", max_restarts=2)
  assert status == 3 and len(runs) == 3  # the first run and 2 restarts, on the same hosts
  assert all(r["np"] == 4 for r in runs)
  assert "restart 1: the job failed without losing a host (exit status 3" in err
  assert "restart 2: the job failed without losing a host" in err
  assert "giving up: the job failed without losing a host (exit status 3; " in err
  assert "the job has been restarted 2 time(s) (--max-restarts 2)" in err


def test_launch_main_checks_the_elastic_flags(capsys, tmp_path):
  assert launch.main(["--max-restarts", "-1", "--", "true"]) == launch.EXIT_USAGE
  assert "--max-restarts -1 must be at least 0" in capsys.readouterr().err
  assert launch.main(["--min-nodes", "0", "--", "true"]) == launch.EXIT_USAGE
  assert launch.main(["--cooldown", "-1", "--", "true"]) == launch.EXIT_USAGE
  hostfile = _hostfile(tmp_path, "a slots=2\n")
  assert launch.main(["--hostfile", hostfile, "-np", "3", "--max-restarts", "1", "--",
                      "true"]) == launch.EXIT_USAGE
  assert "-np 3 is more than the 2 slots" in capsys.readouterr().err
  assert launch.main(["--hostfile", hostfile, "--host-discovery", "x", "--", "true"]
                     ) == launch.EXIT_USAGE
  assert "--hostfile or --host-discovery, not both" in capsys.readouterr().err
  assert launch.main(["--discovery-interval", "0", "--", "true"]) == launch.EXIT_USAGE
  assert launch.main(["--host-discovery", str(tmp_path / "none.sh"), "--", "true"]
                     ) == launch.EXIT_USAGE
  assert "must be an executable file" in capsys.readouterr().err


def test_fault_rig_lost_node_restarts_and_training_goes_on(rig_ready, tmp_path):
  """2 nodes x 2 processes; node B's link goes down in epoch 2; the job ends 0 on node A."""
  from benchmarks.harness import cluster  # pylint: disable=g-import-not-at-top
  from benchmarks.sections import elastic_restart  # pylint: disable=g-import-not-at-top
  from tests import launch as test_launch  # pylint: disable=g-import-not-at-top
  log = str(tmp_path / "log.jsonl")
  epochs = 3
  train = elastic_restart.train_args(epochs, 8, str(tmp_path / "ckpt"), log, every=4,
                                     extra=["--train-limit", "512", "--test-limit", "128"])
  with cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
    result = elastic_restart.run_job(rig, 2, train, fault_after_epoch=1, fault_delay_s=0.5,
                                     timeout=240, env=test_launch.clean_env(1))
  output = result["output"]
  assert result["code"] == 0, output[-4000:]
  assert result["fault_at"] is not None, output[-4000:]
  assert ("jdist launch: restart 1: lost host nodeB (ranks 2, 3); continuing on 2 of 4 "
          "processes") in output, output[-4000:]
  assert "2 replicas take batch 16 each, the same global batch of 32" in output
  assert "resumed from" in output
  epoch_records, summary = elastic_restart.read_log(log)
  assert elastic_restart.log_problems(epoch_records, epochs) == [], epoch_records
  assert [r["train_examples"] for r in epoch_records] == [512] * epochs
  assert summary["topology"]["processes"] == 2 and summary["steps"] == epochs * 16
