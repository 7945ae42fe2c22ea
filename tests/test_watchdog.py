"""The watchdog: a stalled rank ends the job with a report; tolerated delays do not.

Two kinds of tests:

* Unit tests of the report (`describe_stall`) and of the bookkeeping
  (`Watchdog` with a stand-in communicator). Cheap; they run in every
  topology.
* Fault injection (names contain "fault"): each launches its own 2-process
  job (`tests/jobs/stall.py`) under mpirun with a hard timeout, injects a
  fault, and checks how the job ends. They run from plain pytest only: the
  mpirun invocations of the suite pass `-k "not fault"`, and under mpirun
  each of them only checks that it is under mpirun and returns (a job
  launched from inside an MPI job would inherit its world).
"""

import concurrent.futures
import sys
import threading
import time

import jax
import jax.numpy as jnp
import pytest

import jdist
from jdist.runtime import watchdog
from tests import launch
from tests.jobs import faults


# --- the report -------------------------------------------------------------

def _reply(rank, waiting_in=None, **extra):
  reply = {"rank": rank, "dispatched": 4, "completed": 4, "waiting_in": waiting_in,
           "waiting_s": 3.0 if waiting_in else 0.0, "idle_s": 10.2, "compiling": False,
           "where": "train.py:42 in main", "last_completed": "step 4 of train_step"}
  reply.update(extra)
  return reply


def test_report_names_the_idle_rank_its_line_and_last_step():
  text = watchdog.describe_stall(0, 2, "step 5 of train_step", 10.2, 10.0, {1: _reply(1)})
  assert "rank 0 waited 10.2 s in step 5 of train_step" in text
  assert "limit 10 s" in text and "jdist.init(timeout=...)" in text and "JDIST_TIMEOUT" in text
  assert "rank 1: MISSING - not in any exchange for 10.2 s at train.py:42 in main" in text
  assert "last finished: step 4 of train_step" in text
  assert text.splitlines()[-1].startswith("Rank(s) 1 did not reach step 5 of train_step.")


def test_report_names_ranks_that_did_not_answer_among_waiting_ones():
  replies = {1: _reply(1, waiting_in="step 5 of train_step"), 3: _reply(3)}
  text = watchdog.describe_stall(0, 4, "step 5 of train_step", 11.0, 10.0, replies)
  assert "rank 1: waiting in step 5 of train_step for 3.0 s" in text
  assert "rank 2: MISSING - did not answer" in text
  assert "rank 3: MISSING - not in any exchange" in text
  assert "Rank(s) 2, 3 did not reach" in text
  assert "rank 0:" not in text  # the reporting rank does not list itself


def test_report_names_the_host_of_ranks_that_stopped_answering():
  hosts = ["nodeA", "nodeA", "nodeB", "nodeB"]
  replies = {1: _reply(1, waiting_in="step 5 of train_step")}
  text = watchdog.describe_stall(0, 4, "step 5 of train_step", 21.0, 20.0, replies, hosts)
  assert ("ranks 2, 3 on host nodeB stopped answering (every rank of that node is silent: "
          "the node is down or unreachable)") in text
  one = watchdog.describe_stall(0, 4, "step 5 of train_step", 21.0, 20.0,
                                {1: replies[1], 3: _reply(3)}, hosts)
  assert "rank 2 on host nodeB stopped answering (down, unreachable, or hung" in one
  unnamed = watchdog.describe_stall(0, 2, "step 5 of train_step", 21.0, 20.0, {})
  assert "rank 1 stopped answering" in unnamed and "on host" not in unnamed


def test_report_tells_a_stuck_exchange_from_diverged_control_flow():
  same = watchdog.describe_stall(0, 2, "step 7 of train_step", 10.5, 10.0,
                                 {1: _reply(1, waiting_in="step 7 of train_step")})
  assert "Every rank is waiting in step 7 of train_step: the exchange itself is stuck" in same
  assert "MISSING" not in same
  diverged = watchdog.describe_stall(0, 2, "jdist.barrier", 10.5, 10.0,
                                     {1: _reply(1, waiting_in="step 7 of train_step")})
  assert "in different exchanges" in diverged and "diverged" in diverged


def test_report_shows_a_compiling_rank_as_busy_not_missing():
  text = watchdog.describe_stall(0, 2, "step 1 of train_step", 700.0, 10.0,
                                 {1: _reply(1, compiling=True)})
  assert "rank 1: still tracing/compiling with JAX at train.py:42 in main" in text
  assert "MISSING" not in text and "still compiling after the grace period" in text


# --- the bookkeeping ----------------------------------------------------------

class _Comm:
  """Stands in for the watchdog's communicator: rank 0 of 2, no traffic."""

  def Get_rank(self):  # noqa: N802  (mpi4py's spelling)
    return 0

  def Get_size(self):  # noqa: N802
    return 2


class _Marker:
  def __init__(self):
    self.done = threading.Event()

  def block_until_ready(self):
    self.done.wait()


def test_steps_are_numbered_per_function_and_waits_nest():
  dog = watchdog.Watchdog(_Comm(), mpi=None, timeout=5.0)
  dog.step_dispatched(_Marker(), name="init")
  dog.step_dispatched(_Marker(), name="train_step")
  dog.step_dispatched(_Marker(), name="train_step")
  dog.step_dispatched(_Marker())
  status = dog.status()
  assert status["last_dispatched"] == "compiled step 4"
  assert status["dispatched"] == 4 and dog.step == 4
  assert dog._calls == {"init": 1, "train_step": 2}  # pylint: disable=protected-access
  with dog.waiting("outer"):
    with dog.waiting("structure check"):
      assert dog.status()["waiting_in"] == "structure check"
    assert dog.status()["waiting_in"] == "outer"
  assert dog.status()["waiting_in"] is None


def test_only_a_wait_past_its_deadline_overruns():
  dog = watchdog.Watchdog(_Comm(), mpi=None, timeout=0.2)
  assert dog._overrun() is None  # pylint: disable=protected-access
  with dog.waiting("jdist.barrier"):
    assert dog._overrun() is None  # pylint: disable=protected-access
    time.sleep(0.3)
    wait = dog._overrun()  # pylint: disable=protected-access
    assert wait is not None and wait.label == "jdist.barrier"
    assert dog._still_waiting(wait)  # pylint: disable=protected-access
  assert not dog._still_waiting(wait)  # pylint: disable=protected-access
  assert dog._overrun() is None  # pylint: disable=protected-access


def test_status_reports_where_the_main_thread_is():
  dog = watchdog.Watchdog(_Comm(), mpi=None, timeout=5.0)
  status = dog.status()  # asked from the main thread itself, here
  assert status["where"].startswith("tests/test_watchdog.py:")
  assert "test_status_reports_where_the_main_thread_is" in status["where"]
  assert status["compiling"] is False


def test_tracing_counts_as_compiling_but_not_a_host_wait_made_while_tracing():
  dog = watchdog.Watchdog(_Comm(), mpi=None, timeout=5.0)
  seen = []

  def traced(x):
    seen.append(dog.status()["compiling"])
    with dog.waiting("structure check of jdist.psum"):  # blocked on peers, not compiling
      seen.append(dog.status()["compiling"])
    return x + 1

  jax.jit(traced)(jnp.ones(3)).block_until_ready()
  assert seen == [True, False]
  assert dog.status()["compiling"] is False  # running compiled code is not compiling


class _DepartedPeer(_Comm):
  """Rank 1 has exited after `steps` steps and `host` host exchanges."""

  def __init__(self, steps, host):
    self.pending = [{"rank": 1, "steps": steps, "host": host}]

  def Iprobe(self, source, tag, status):  # noqa: N802
    del source, status
    return tag == watchdog._DEPART_TAG and bool(self.pending)  # pylint: disable=protected-access

  def recv(self, source, tag):
    del source, tag
    return self.pending.pop()


class _Mpi:
  ANY_SOURCE = -1

  class Status:
    def Get_source(self):  # noqa: N802
      return 1


def test_a_wait_a_departed_rank_never_reached_is_reported(monkeypatch):
  monkeypatch.setattr(watchdog, "DEPARTURE_GRACE_S", 0.0)
  dog = watchdog.Watchdog(_DepartedPeer(steps=3, host=0), mpi=_Mpi, timeout=60.0)
  assert dog._departure_stall() is None  # pylint: disable=protected-access
  with dog.waiting("jdist.barrier"):  # host exchange 1; rank 1 made none
    report = dog._departure_stall()  # pylint: disable=protected-access
  assert ("rank 0 waits in jdist.barrier (its host exchange 1), but rank 1 exited after 0 "
          "host exchanges, so it can never arrive") in report
  # Steps: rank 1 finished 3, so step 3 will complete; step 4 never can.
  for number, reported in ((3, False), (4, True)):
    dog._step_wait = dog._new_wait(  # pylint: disable=protected-access
        f"step {number} of train_step", time.monotonic(), number, host=False)
    report = dog._departure_stall()  # pylint: disable=protected-access
    assert (report is not None) == reported
  assert "rank 1 exited after 3 steps" in report and "left its loop early" in report


def test_divergence_needs_a_step_and_a_host_exchange_that_exclude_each_other():
  step = {"waiting_in": "step 7 of train_step", "host_wait": False, "waiting_s": 6.0,
          "wait_number": 8, "dispatched": 8}
  check = {"waiting_in": "structure check of jdist.psum", "host_wait": True, "waiting_s": 6.0,
           "wait_number": 40, "dispatched": 7, "where": "train.py:9 in main",
           "trace_note": "it is tracing train_step again: argument [2] is now float16[4] "
                         "(was float32[4])"}
  found = watchdog.find_divergence({0: step, 1: check}, 5.0)
  assert found is not None and found[0] == 0 and found[2] == 1
  text = watchdog.describe_divergence(1, *found)
  assert "rank 0 waits in step 7 of train_step (its compiled step 8), but rank 1 " \
         "dispatched only 7 steps and waits in structure check of jdist.psum" in text
  assert "argument [2] is now float16[4] (was float32[4])" in text
  # Not (yet) a divergence: too young, or the peer did dispatch that step.
  assert watchdog.find_divergence({0: step, 1: dict(check, waiting_s=1.0)}, 5.0) is None
  assert watchdog.find_divergence({0: step, 1: dict(check, dispatched=8)}, 5.0) is None


def test_where_in_jdist_train_is_the_training_loop_not_the_console_script():
  from jdist.app import train_loop  # pylint: disable=import-outside-toplevel

  class Code:
    def __init__(self, path, name):
      self.co_filename, self.co_name = path, name

  class Frame:
    def __init__(self, path, line, name, back):
      self.f_code, self.f_lineno, self.f_back = Code(path, name), line, back

  script = Frame("/venv/bin/jdist", 8, "<module>", None)
  outer = Frame(train_loop.__file__.replace("train_loop", "train"), 190, "train", script)
  loop = Frame(train_loop.__file__, 240, "run_epoch", outer)
  inner = Frame(watchdog.__file__, 30, "waiting", loop)
  assert watchdog.user_location(inner).endswith("jdist/app/train_loop.py:240 in run_epoch")


def test_compile_grace_has_a_bound():
  assert watchdog.Watchdog(_Comm(), mpi=None, timeout=10.0).compile_grace == 600.0
  assert watchdog.Watchdog(_Comm(), mpi=None, timeout=300.0).compile_grace == 3000.0


# --- fault injection: separate mpirun jobs, plain pytest only ------------------

# Each fault test's job: keyword arguments of tests.jobs.faults.run.
_JOBS = {
    "stall_2x1": dict(faults=["stall:5"], devices=1, timeout=10.0),
    "stall_2x2": dict(faults=["stall:5"], devices=2, timeout=10.0),
    # Rank 1 is 3 s late at step 3; rank 0 writes a 6 s "checkpoint" at step 6
    # while rank 1 waits in a barrier: both within the 10 s deadline.
    "tolerated": dict(faults=["late:3", "checkpoint:6"], timeout=10.0,
                      extra=["--late", "3", "--checkpoint", "6"]),
    "compile": dict(faults=["compile:1"], timeout=2.0, extra=["--compile", "6"]),
    "kill": dict(faults=["kill:5"], timeout=60.0),
    "raise": dict(faults=["raise:5"], timeout=60.0),
    "exit": dict(faults=["exit:5"], timeout=60.0),
    "preinit": dict(faults=["preinit:0"], timeout=60.0, env={"JDIST_INIT_TIMEOUT": "5"}),
    "prempi": dict(faults=["prempi:0"], timeout=60.0, env={"JDIST_INIT_TIMEOUT": "3"},
                   extra=["--sleep", "8"]),
    "barrier": dict(faults=["barrier:5"], timeout=5.0),
    # Many steps back to back: XLA:CPU deadlocked (a collective's rendezvous
    # times out after 40 s and aborts) once more than 32 steps were in flight
    # and launches blocked its few pool threads, in one process as in several,
    # unless data_parallel bounds the steps in flight.
    "back_to_back_2x2": dict(faults=[], devices=2, timeout=10.0, extra=["--steps", "200"]),
    "back_to_back_1x2": dict(faults=[], processes=1, devices=2,
                             extra=["--steps", "150", "--per-replica", "4096"]),
    # Divergences found in seconds under the DEFAULT deadline (300 s); the
    # hard limit fails the test long before it.
    "retrace_2x1": dict(faults=["retrace:5"], timeout=300.0, hard_limit=150.0),
    "retrace_2x2": dict(faults=["retrace:5"], devices=2, timeout=300.0, hard_limit=150.0),
    "dtype_2x1": dict(faults=["dtype:5"], timeout=300.0, hard_limit=150.0),
    "extra_2x1": dict(faults=["extra:10"], timeout=300.0, hard_limit=150.0),
    "extra_2x2": dict(faults=["extra:10"], devices=2, timeout=300.0, hard_limit=150.0),
    "hostexit": dict(faults=["hostexit:5"], timeout=60.0),
}
_PARALLEL_JOBS = 2  # jobs run two at a time: each is mostly start-up and waiting


@pytest.fixture(scope="module")
def fault_jobs(request):
  """Starts the jobs of the selected fault tests at once; maps job name to a future."""
  if launch.under_mpirun():
    yield {}  # never launch a job from inside an MPI job
    return
  wanted = []
  for item in request.session.items:
    callspec = getattr(item, "callspec", None)
    name = callspec.params.get("job") if callspec else None
    if name in _JOBS and item.module is sys.modules[__name__] and name not in wanted:
      wanted.append(name)
  with concurrent.futures.ThreadPoolExecutor(_PARALLEL_JOBS) as pool:
    futures = {}
    for name in wanted:
      futures[name] = pool.submit(faults.run, **_JOBS[name])
    yield futures
    for future in futures.values():
      future.cancel()


def _job(fault_jobs, name):
  if launch.under_mpirun():
    assert not fault_jobs
    pytest.skip("fault jobs are launched from plain pytest only")
  result = fault_jobs[name].result()
  faults.report(name, result)
  return result


def _explain(result):
  return (f"exit {result.returncode} after {result.elapsed:.1f} s\nstdout:\n{result.stdout[-2000:]}\n"
          f"stderr:\n{result.stderr[-4000:]}")


@pytest.mark.parametrize("job", ["stall_2x1", "stall_2x2"])
def test_fault_stalled_rank_aborts_the_job_naming_rank_and_step(fault_jobs, job):
  timeout = _JOBS[job]["timeout"]
  result = _job(fault_jobs, job)
  why = faults.check_stall_abort(result, timeout, step=5)
  assert why is None, f"{why}\n{_explain(result)}"
  # The flight recorders: rank 0 posted step 5's exchanges, rank 1 never did.
  for text in (_FLIGHT_STEP, _NEVER_1):
    assert text in result.stderr, _explain(result)
  assert result.since("sleeping") >= timeout  # not before the deadline either
  assert not [text for text in _FOREIGN if text in result.stderr], _explain(result)


@pytest.mark.parametrize("job", ["compile"])
def test_fault_slow_compile_on_one_rank_does_not_count(fault_jobs, job):
  result = _job(fault_jobs, job)
  assert result.returncode == 0, _explain(result)
  compiled = float(result.stderr.split("compiled for ")[1].split(" s")[0])
  assert compiled > 2 * _JOBS["compile"]["timeout"], _explain(result)  # well past the deadline


# How each job must end. ok: exit status 0 (else not 0); within: (a line the
# job logs, seconds it must end within after that line); after: seconds it
# must not end before; before_deadline: `within` ends it before the job's own
# deadline; stdout/stderr: texts that must appear; absent: texts stderr must not hold.
# The flight recorder's section of every hang report (tests/test_flight_recorder.py).
_FLIGHT_STEP = "Flight recorder: the ranks first disagree at exchange ordinal "
_FLIGHT_HOST = "Flight recorder: the ranks first disagree at host exchange "
_NEVER_1 = "never posted by rank(s) 1."
# What JAX's coordination client and Open MPI's signal handler print on the
# other ranks while the job ends; the aborting rank silences them (abort.py),
# and a rank that leaves while others still run silences itself.
_FOREIGN = ("Check failure stack trace", "coordination service", "Terminating process",
            "Process received signal")
_RETRACE = ("rank 1 dispatched only", "Rank 1 is re-tracing a step the other ranks run compiled",
            "Flight recorder: the ranks first disagree at ", "never posted by rank(s) ")
_OUTCOMES = {
    "tolerated": dict(ok=True, stdout=["jdist-job: done"], absent=["jdist watchdog"]),
    "kill": dict(ok=False, within=("killing", 15)),
    # Without the watchdog's excepthook, the raising rank would wait in
    # MPI_Finalize and the other in its step until the 60 s deadline.
    "raise": dict(ok=False, within=("raising", 15),
                  stderr=["RuntimeError: injected failure on rank 1",
                          "rank 1 stopped on an uncaught RuntimeError"]),
    # sys.exit is no uncaught exception: the rank exits cleanly after its steps
    # and announces how far it got; rank 0, waiting in step 5, aborts then.
    "exit": dict(ok=False, within=("exiting", watchdog.DEPARTURE_GRACE_S + 15),
                 before_deadline=True,
                 stderr=["rank 0 waits in step 5 of train_step", "rank 1 exited after",
                         _FLIGHT_STEP, _NEVER_1]),
    "preinit": dict(ok=False, within=("sleeping", 5 + 15),
                    stderr=["waited 5 s in jdist.init() for rank(s) 1, which never called it"]),
    # Rank 0 sits in MPI_Init until rank 1 starts MPI, 8 s late: past the 3 s
    # limit it says why, and the job still runs once rank 1 arrives.
    "prempi": dict(ok=True, stdout=["jdist-job: done"],
                   stderr=["rank 0 has waited 3 s in jdist.init() for MPI to start"]),
    "barrier": dict(ok=False, after=("sleeping", _JOBS["barrier"]["timeout"]),
                    within=("sleeping", _JOBS["barrier"]["timeout"] + 15),
                    stderr=["in jdist.barrier", "rank 1: MISSING",
                            _FLIGHT_HOST, "(jdist.barrier), first posted", _NEVER_1]),
    "back_to_back_2x2": dict(ok=True, stdout=["jdist-job: done"]),
    "back_to_back_1x2": dict(ok=True, stdout=["jdist-job: done"]),
    "retrace_2x1": dict(ok=False, within=("re-tracing", watchdog.DIVERGENCE_GRACE_S + 20),
                        stderr=[*_RETRACE, "argument [2] is now float32[3, 8, 8, 1] "
                                "(was float32[4, 8, 8, 1])"]),
    "retrace_2x2": dict(ok=False, within=("re-tracing", watchdog.DIVERGENCE_GRACE_S + 20),
                        stderr=[*_RETRACE, "argument [2] is now float32[3, 8, 8, 1] "
                                "(was float32[4, 8, 8, 1])"]),
    "dtype_2x1": dict(ok=False, within=("re-tracing", watchdog.DIVERGENCE_GRACE_S + 20),
                      stderr=[*_RETRACE, "argument [2] is now float16[4, 8, 8, 1] "
                              "(was float32[4, 8, 8, 1])"]),
    # Found at the next host exchange, before the extra step pairs with another.
    **{job: dict(ok=False, within=("running step", watchdog.DIVERGENCE_GRACE_S + 20),
                 stderr=["after training: the ranks ran different numbers of "
                         "jdist.data_parallel steps before this exchange (rank 0 11, rank 1 12)"],
                 absent=["MPI_ERR_TRUNCATE"]) for job in ("extra_2x1", "extra_2x2")},
    # 20 barriers that complete at once must be counted alike on every rank.
    "hostexit": dict(ok=False, within=("exiting", watchdog.DEPARTURE_GRACE_S + 15),
                     before_deadline=True,
                     stderr=["rank 0 waits in after the exit", "rank 1 exited after",
                             _FLIGHT_HOST, "(after the exit), first posted", _NEVER_1]),
}


@pytest.mark.parametrize("job", list(_OUTCOMES))
def test_fault_job_ends_as_expected(fault_jobs, job):
  expected = _OUTCOMES[job]
  result = _job(fault_jobs, job)
  assert (result.returncode == 0) == expected["ok"], _explain(result)
  if "within" in expected:
    line, seconds = expected["within"]
    assert result.since(line) < seconds, _explain(result)
    if expected.get("before_deadline"):
      assert seconds < _JOBS[job]["timeout"]
  if "after" in expected:
    line, seconds = expected["after"]
    assert result.since(line) >= seconds, _explain(result)
  for text in expected.get("stdout", ()):
    assert text in result.stdout, _explain(result)
  for text in expected.get("stderr", ()):
    assert text in result.stderr, _explain(result)
  for text in expected.get("absent", ()):
    assert text not in result.stderr, _explain(result)
  assert not [text for text in _FOREIGN if text in result.stderr], _explain(result)
