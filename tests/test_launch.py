"""`jdist launch`: the supervisor around mpirun (jdist/app/launch.py).

Fake "mpirun" commands (small Python scripts) stand in for the job, so each
behaviour a real job shows on the multi-node rig (tests/test_cluster.py) is
checked here in a second: an abort report followed by an mpirun that never
ends, PRRTE's lost-daemon message with exit status 0, plain success and
failure.
"""

import io
import os
import sys
import time

from jdist.app import launch
from jdist.app import supervise
from jdist.runtime import abort

LOST_DAEMON = """\
--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-vm-4873@0,0] on node vm
  Remote daemon: [prterun-vm-4873@0,2] on node nodeB

This is usually due to either a failure of the TCP network
connection to the node.
--------------------------------------------------------------------------
"""


def _fake(code: str) -> list:
  return [sys.executable, "-c", code]


def _supervise(code: str, **kwargs):
  out, err = io.StringIO(), io.StringIO()
  status, state = launch.supervise(_fake(code), stdout=out, stderr=err, **kwargs)
  return status, state, out.getvalue(), err.getvalue()


def test_a_clean_job_passes_its_output_and_status_through():
  status, state, out, err = _supervise("print('epoch 1'); import sys; sys.exit(0)")
  assert status == 0 and out == "epoch 1\n" and err == ""
  assert state.failure() is None
  status, _, _, _ = _supervise("import sys; sys.exit(3)")
  assert status == 3


def test_the_host_map_is_consumed_not_shown():
  line = f"{abort.HOSTS_MARKER} 0:nodeA 1:nodeA 2:nodeB 3:nodeB"
  status, state, out, _ = _supervise(f"print({line!r}); print('hello')")
  assert status == 0 and out == "hello\n"
  assert state.hosts == {0: "nodeA", 1: "nodeA", 2: "nodeB", 3: "nodeB"}


def test_a_lost_daemon_reported_with_status_0_is_a_failure_naming_host_and_ranks():
  code = (f"import sys; print({abort.HOSTS_MARKER + ' 0:nodeA 1:nodeA 2:nodeB 3:nodeB'!r}); "
          f"sys.stderr.write({LOST_DAEMON!r}); sys.exit(0)")
  status, _, _, err = _supervise(code)
  assert status == launch.EXIT_FAILURE
  assert "PRTE has lost communication" in err  # the job's own output is kept
  assert err.rstrip().endswith("jdist launch: the job failed: lost host nodeB (ranks 2, 3).")


def test_a_daemon_that_died_with_its_node_is_a_lost_host():
  message = ("A daemon failed to report back after being spawned.\n\n"
             "  Local host:    vm\n  Remote host:   nodeB\n  Daemon exit status: 0\n")
  code = f"import sys; sys.stderr.write({message!r}); sys.exit(0)"
  status, _, _, err = _supervise(code)
  assert status == launch.EXIT_FAILURE
  assert "the job failed: lost host nodeB." in err
  assert launch.JobState().read("  Remote host:   nodeB\n")  # no failure seen: not lost


def test_an_mpirun_that_hangs_after_an_abort_is_stopped_after_the_grace():
  report = ("jdist watchdog: rank 0 waited 25.2 s\n"
            "ranks 2, 3 on host nodeB stopped answering (the node is down or unreachable).\n"
            f"{abort.ABORT_MARKER} (rank 0, exit code 1)\n")
  code = f"import sys, time; sys.stderr.write({report!r}); sys.stderr.flush(); time.sleep(600)"
  began = time.monotonic()
  status, _, _, err = _supervise(code, abort_grace=1.0)
  assert time.monotonic() - began < 1.0 + 2 * supervise.KILL_GRACE_S + 5
  assert status == launch.EXIT_FAILURE
  assert "mpirun still runs 1 s after the job aborted" in err
  assert "jdist launch: the job failed: lost host nodeB (ranks 2, 3)." in err


def test_an_abort_without_a_lost_node_says_a_rank_aborted():
  code = f"import sys; sys.stderr.write({abort.ABORT_MARKER + ' (rank 1, exit code 1)'!r}); sys.exit(1)"
  status, _, _, err = _supervise(code)
  assert status == 1
  assert "the job failed: a rank aborted the job" in err


def test_mpirun_argv_and_environment():
  argv = launch.mpirun_argv(["jdist", "train"], mpirun="/x/mpirun", hostfile="hosts",
                            processes=4, mpirun_args=["--map-by", "slot"])
  assert argv[:5] == ["/x/mpirun", "--hostfile", "hosts", "-np", "4"]
  assert argv[-6:] == ["--map-by", "slot", "-x", abort.LAUNCH_ENV, "jdist", "train"]
  env = supervise.environment()
  assert env[abort.LAUNCH_ENV] == "1"
  for name, value in supervise.KEEPALIVE_DEFAULTS.items():
    assert env[name] == os.environ.get(name, value)


def test_bad_arguments_are_one_line_errors(capsys):
  assert launch.main([]) == launch.EXIT_USAGE
  assert "no command" in capsys.readouterr().err
  assert launch.main(["-np", "0", "--", "true"]) == launch.EXIT_USAGE
  assert "-np 0 must be at least 1" in capsys.readouterr().err
  assert launch.main(["--abort-grace", "0", "--", "true"]) == launch.EXIT_USAGE


def test_host_map_round_trips(capsys, monkeypatch):
  monkeypatch.setenv(abort.LAUNCH_ENV, "1")
  abort.announce_hosts(["a", "b"])
  line = capsys.readouterr().out
  assert abort.parse_hosts(line) == {0: "a", 1: "b"}
  monkeypatch.delenv(abort.LAUNCH_ENV)
  abort.announce_hosts(["a", "b"])
  assert capsys.readouterr().out == ""


def test_lost_lists_prrte_hosts_then_the_watchdogs_silent_hosts_once():
  state = launch.JobState()
  for line in ("ranks 4, 5 on host nodeC stopped answering (the node is down)\n",
               LOST_DAEMON, "ranks 2, 3 on host nodeB stopped answering\n"):
    for part in line.splitlines(keepends=True):
      state.read(part)
  assert state.lost() == ["nodeB", "nodeC"]
  assert state.silent == {"nodeC": [4, 5], "nodeB": [2, 3]}
