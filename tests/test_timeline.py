"""jdist.timeline: the trace's contents, its split of step time, and its summary.

Unit tests build traces from fabricated records (`timeline_format`) and feed
a `Timeline` step and exchange events as the watchdog and the callback
route would. Under mpirun (scripts/test.sh: 2x1 and 2x2) a real
`jdist.data_parallel` step is recorded and every rank and exchange must be
in rank 0's file.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import pytest

import jdist
from jdist.tracing import chrome_trace as timeline_format
from jdist.tracing import recorder as timeline_recorder
from jdist.app import timeline_cli
from jdist.runtime import flight_recorder
from jdist.runtime import host
from tests import launch

MS = 1_000_000  # ns


def _x(ordinal, call, first, last, wire, done, nbytes=1000, kind="sum"):
  return ("x", ordinal, call, kind, f"allreduce: {kind}", nbytes, first, last, wire, done,
          "native")


def _part(shift=0, steps=None, exchanges=None):
  return {"steps": steps if steps is not None else [("step", 1, "train_step", 0, 10 * MS)],
          "exchanges": exchanges if exchanges is not None else [
              _x(0, 0, 2 * MS, 2 * MS, 3 * MS, 5 * MS), _x(1, 0, 6 * MS, 7 * MS, 7 * MS, 9 * MS)],
          "wall_minus_mono_ns": shift, "host": "node", "dropped": 0}


def test_steps_window_parses_and_rejects_nonsense():
  assert timeline_recorder.parse_steps("5:30") == (5, 30)
  assert timeline_recorder.parse_steps("5:") == (5, None)
  assert timeline_recorder.parse_steps(":9") == (None, 9)
  assert timeline_recorder.parse_steps(None) is None
  for bad in ("5", "a:b", "9:3"):
    with pytest.raises(ValueError, match="--timeline-steps"):
      timeline_recorder.parse_steps(bad)


def test_a_step_splits_into_compute_exposed_exchange_and_waiting():
  part = _part()
  (split,) = timeline_format.step_splits(part["steps"], part["exchanges"], {(1, 0): 1 * MS})
  # The last exchange was posted at 7 ms and done at 9 ms: 2 ms exposed, of which
  # 1 ms waiting for the slowest rank; the first one hid behind compute.
  assert (split["exposed"], split["waiting"], split["compute"]) == (1 * MS, 1 * MS, 8 * MS)
  assert split["bytes"] == 2000 and split["exchanges"] == 2


def test_a_late_psum_of_the_step_does_not_end_the_backward_pass():
  metric = ("x", 2, 0, "sum", "psum/pmean: dense sum", 4, 8 * MS, 8 * MS, 8 * MS, 9 * MS,
            "native")
  part = _part(exchanges=_part()["exchanges"] + [metric])
  (split,) = timeline_format.step_splits(part["steps"], part["exchanges"])
  # The gradient's last bucket was posted at 7 ms; the metric sum, posted at 8 ms, is
  # done at 9 ms: 2 ms exposed, not 1.
  assert (split["exposed"], split["compute"]) == (2 * MS, 8 * MS)


def test_waits_for_the_slowest_rank_use_each_ranks_wall_clock():
  late = _part(shift=0, exchanges=[_x(1, 0, 6 * MS, 8 * MS, 8 * MS, 9 * MS)])
  early = _part(shift=-1 * MS, exchanges=[_x(1, 0, 6 * MS, 7 * MS, 7 * MS, 9 * MS)])
  waits = timeline_format.slowest_waits({0: late, 1: early})
  assert waits[0][(1, 0)] == 0 and waits[1][(1, 0)] == 2 * MS  # 7 - 1 vs 8: 2 ms earlier


def test_the_trace_has_a_process_per_rank_steps_and_non_overlapping_exchange_lanes(tmp_path):
  overlapping = [_x(0, 0, 1 * MS, 2 * MS, 2 * MS, 6 * MS), _x(1, 0, 3 * MS, 3 * MS, 4 * MS, 8 * MS)]
  trace = timeline_format.chrome_trace({0: _part(), 1: _part(shift=5, exchanges=overlapping)})
  path = str(tmp_path / "t.json")
  timeline_format.write_atomically(path, trace)
  events = json.load(open(path, encoding="utf-8"))["traceEvents"]
  assert os.listdir(tmp_path) == ["t.json"]  # no temporary file left behind
  names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
  assert names == {0: "rank 0 (node)", 1: "rank 1 (node)"}
  for rank in (0, 1):
    outer = [e for e in events if e["pid"] == rank and e["ph"] == "X"
             and e["name"].startswith("#")]
    assert sorted((e["args"]["ordinal"], e["args"]["call"]) for e in outer) == [(0, 0), (1, 0)]
    assert all(e["args"]["bytes"] == 1000 and e["args"]["payload"] for e in outer)
    assert [e["name"] for e in events if e["pid"] == rank and e.get("cat") == "step"] == \
        ["step 1"]
    assert {e["name"] for e in events if e["pid"] == rank and e["ph"] == "C"} == \
        {"step time (ms)", "bytes per step"}
  lanes = {e["tid"] for e in events if e["pid"] == 1 and e["name"].startswith("#")}
  assert len(lanes) == 2  # the two exchanges of rank 1 overlap: one lane each
  phases = {e["name"] for e in events if e["pid"] == 0 and e.get("cat") == "exchange"}
  assert {"on the wire", "posted", "local reduce"} <= phases


def test_summarize_prints_the_split_per_rank_and_plots_it(tmp_path, capsys):
  path = str(tmp_path / "t.json")
  timeline_format.write_atomically(path, timeline_format.chrome_trace({0: _part(), 1: _part()}))
  assert timeline_cli.main(["summarize", path, "--plot", str(tmp_path / "t.png")]) == 0
  text = capsys.readouterr().out
  rows = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"])]
  assert [row[:3] for row in rows] == [["0", "1", "10.00"], ["1", "1", "10.00"]]
  assert (tmp_path / "t.png").stat().st_size > 1000
  assert timeline_cli.main(["summarize", str(tmp_path / "t.png")]) == 1  # not a trace


def test_parts_written_on_an_abort_are_merged(tmp_path, capsys):
  path = str(tmp_path / "t.json")
  for rank, name in ((0, path), (1, path + ".rank1.json")):
    timeline_format.write_atomically(name, timeline_format.chrome_trace({rank: _part()},
                                                                        complete=False))
  parts, complete = timeline_cli.load(path)
  assert sorted(parts) == [0, 1] and not complete
  assert timeline_cli.main(["summarize", path]) == 0
  assert "incomplete trace" in capsys.readouterr().out


def test_a_timeline_records_the_window_of_a_functions_steps(tmp_path):
  jdist.init()
  flight_recorder.reset()
  path = str(host.allgather_object(str(tmp_path / "t.json"))[0])
  recorder = jdist.timeline(path, steps="2:3", function="train_step")
  try:
    for number, name in ((1, "train_step"), (2, "train_step"), (3, "eval_step"),
                         (4, "train_step")):
      call = 1 if number == 1 else 2 if number in (2, 3) else 3
      flight_recorder.step_dispatched(number, name, 0, call)
      key = flight_recorder.device_posted(0, 0, "sum", 64, devices=1)  # as the callback route
      flight_recorder.device_done(key)
      flight_recorder.step_done(number, 0, 1000 * number)
    assert recorder.close() == (path if jax.process_index() == 0 else None)
  finally:
    flight_recorder.reset()
  if jax.process_index() == 0:
    part = json.load(open(path, encoding="utf-8"))["otherData"]["parts"]["0"]
    # Train step 2 opens the window, eval step 3 runs in it, train step 3 (number 4) closes it.
    assert [(s[1], s[2]) for s in part["steps"]] == [(2, "train_step"), (3, "eval_step")]
    assert len(part["exchanges"]) == 2


def test_a_stopped_timeline_leaves_the_engines_rows_to_the_next(tmp_path, monkeypatch):
  """The engine's rows are the process's: a closed timeline's poller, or a late
  step report from the watchdog, must not take the next timeline's (CI lost
  one exchange of four this way, under load)."""
  jdist.init()
  rows = []  # the engine's trace, as native.take_trace hands it out

  def take_trace(max_rows=1 << 16):
    taken, rows[:] = rows[:max_rows], rows[max_rows:]
    return taken

  monkeypatch.setattr(timeline_recorder.native, "take_trace", take_trace)
  monkeypatch.setattr(timeline_recorder.native, "enable_trace", lambda on: False)
  monkeypatch.setattr(timeline_recorder.jit_steps, "any_traced", lambda: True)
  path = str(host.allgather_object(str(tmp_path / "t.json"))[0])
  first = jdist.timeline(path)
  first.close()
  poller = first._poller  # pylint: disable=protected-access
  assert poller is not None and not poller.is_alive()
  second = timeline_recorder.Timeline(path).start()
  try:
    second.step_dispatched(1, "step", 0, 1)
    rows.append((0, 7, 0, 64, 10, 20, 30, 40))  # the next timeline's exchange ends
    first.step_done(1, 0, 50)  # a late report to the stopped one
    second.step_done(1, 0, 50)
    exchanges = [r for r in second.records if r[0] == "x"]
    assert [(x[1], x[2]) for x in exchanges] == [(0, 7)]
  finally:
    second.stop()


def test_every_rank_and_exchange_of_a_real_step_is_in_the_file(tmp_path):
  jdist.init()
  path = str(host.allgather_object(str(tmp_path / "real.json"))[0])

  @jdist.data_parallel
  def step(x):
    return jdist.pmean(x * 2.0)

  x = jnp.ones((jax.local_device_count(), 1024))
  with jdist.timeline(path):
    for _ in range(4):
      y = step(x)
    jax.block_until_ready(y)
  processes = jdist.get_topology().process_count
  if jdist.get_topology().process_index != 0:
    return
  trace = json.load(open(path, encoding="utf-8"))
  events = trace["traceEvents"]
  assert {e["pid"] for e in events if e["name"] == "process_name"} == set(range(processes))
  for rank in range(processes):
    steps = [e for e in events if e["pid"] == rank and e.get("cat") == "step"]
    exchanges = [e for e in events if e["pid"] == rank and e["ph"] == "X"
                 and e["name"].startswith("#")]
    if processes > 1:  # the watchdog times the steps; exchanges cross processes
      assert len(steps) == 4
      calls = sorted(e["args"]["call"] for e in exchanges)  # one exchange per step
      assert calls == list(range(calls[0], calls[0] + 4))
      assert all(e["args"]["bytes"] == 4096 and e["args"]["ordinal"] == 0 for e in exchanges)
    else:
      assert not exchanges  # one process: nothing crosses processes


def _jit_train_step():
  """A jit step over global arrays, as README's quickstart writes it."""
  import optax  # pylint: disable=g-import-not-at-top
  tx = jdist.dist_opt(optax.sgd(0.1))

  def loss_fn(params, batch):
    return jnp.mean((batch @ params["w"]) ** 2)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return jax.tree.map(lambda p, u: p + u, params, updates), opt_state, jdist.pmean(loss)

  params = jdist.broadcast_params({"w": jnp.ones((16, 256))})
  return train_step, params, tx.init(params)


def _run_jit_steps(path, count, **window):
  train_step, params, opt_state = _jit_train_step()
  batch = jdist.shard_global_batch(jnp.ones((8 * jdist.get_topology().replica_count, 16)))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with jdist.timeline(path, **window):
      for _ in range(count):
        params, opt_state, loss = train_step(params, opt_state, batch)
      jax.block_until_ready(loss)
  return [str(w.message) for w in caught if "jdist.timeline" in str(w.message)]


@pytest.mark.parametrize("window,recorded", [({}, [1, 2, 3, 4, 5]),
                                             ({"steps": "2:4"}, [2, 3]),
                                             ({"steps": "3:", "function": "train_step"},
                                              [3, 4, 5])])
def test_jit_steps_and_their_exchanges_are_recorded_on_every_rank(tmp_path, window, recorded):
  jdist.init()
  path = str(host.allgather_object(str(tmp_path / "jit.json"))[0])
  with jax.set_mesh(jdist.mesh()):
    warned = _run_jit_steps(path, 5, **window)
  topo = jdist.get_topology()
  if topo.process_count == 1:  # nothing crosses processes: nothing to time the steps by
    assert any("one process" in w and "train_step" in w for w in warned), warned
    return
  assert not warned, warned
  if topo.process_index != 0:
    return
  parts = json.load(open(path, encoding="utf-8"))["otherData"]["parts"]
  assert sorted(parts) == [str(r) for r in range(topo.process_count)]
  for part in parts.values():
    assert [(s[1], s[2]) for s in part["steps"]] == [(n, "train_step") for n in recorded]
    # Two exchanges per step: the gradients' (dist_opt) and the loss's pmean.
    assert len(part["exchanges"]) == 2 * len(recorded), part["exchanges"]
    for _, _, _, start, done in part["steps"]:
      assert start <= done
  rows = timeline_format.step_splits(parts["0"]["steps"], parts["0"]["exchanges"], {})
  assert all(row["exchanges"] == 2 for row in rows), rows


def test_a_step_function_that_cannot_be_recorded_is_warned_about(tmp_path):
  jdist.init()
  path = str(host.allgather_object(str(tmp_path / "none.json"))[0])
  with jax.set_mesh(jdist.mesh()):
    warned = _run_jit_steps(path, 2, function="eval_step")
  assert any("no step of eval_step was recorded" in w and "jax.jit step" in w
             for w in warned), warned


# --- whole jobs (plain pytest only: each launches mpirun) -----------------------

def _launch_job(tmp_path, *flags, devices=1):
  """Starts tests/jobs/timeline_job.py under mpirun (2 processes); its stderr goes to a file."""
  env = launch.clean_env(devices)
  stderr = open(tmp_path / "stderr.txt", "w", encoding="utf-8")  # pylint: disable=consider-using-with
  argv = launch.mpirun_argv([sys.executable, "tests/jobs/timeline_job.py",
                             str(tmp_path / "t.json"), *flags])
  process = subprocess.Popen(argv, env=env, cwd=launch.REPO, stdout=subprocess.DEVNULL,
                             stderr=stderr, start_new_session=True)
  return process, tmp_path / "stderr.txt"


def _end(process, limit):
  try:
    return process.wait(timeout=limit)
  finally:
    if process.poll() is None:  # hung: end every process of the job
      for pid in launch._session_members(process.pid):  # pylint: disable=protected-access
        with contextlib.suppress(ProcessLookupError):
          os.kill(pid, signal.SIGKILL)


def _parts(tmp_path):
  """Each part file's ranks and steps; every file must load as JSON."""
  found = {}
  for name in sorted(os.listdir(tmp_path)):
    if name.startswith("t.json"):
      assert not name.endswith(".tmp"), name  # written through a rename: no leftover
      with open(tmp_path / name, encoding="utf-8") as stream:
        parts = json.load(stream)["otherData"]["parts"]
      found[name] = {int(rank): len(part["steps"]) for rank, part in parts.items()}
  return found


def _only_from_plain_pytest():
  if jdist.get_topology().process_count > 1:
    pytest.skip("whole jobs are launched from plain pytest only")


def test_a_watchdog_abort_leaves_every_ranks_part(tmp_path):
  _only_from_plain_pytest()
  process, _ = _launch_job(tmp_path, "--stall", "4", "--timeout", "5", devices=2)
  assert _end(process, 200) != 0
  found = _parts(tmp_path)
  # Rank 0 waited in step 4 (3 recorded); rank 1, stalled, had finished 3 steps.
  assert found == {"t.json": {0: 3}, "t.json.rank1.json": {1: 3}}, found


def test_sigint_mid_run_leaves_valid_json(tmp_path):
  _only_from_plain_pytest()
  process, stderr = _launch_job(tmp_path, "--steps", "400", "--slow", "0.05")
  deadline = time.monotonic() + 150
  while "step 5 " not in stderr.read_text() and time.monotonic() < deadline:
    time.sleep(0.2)
  os.kill(process.pid, signal.SIGINT)  # as Ctrl-C on mpirun
  assert _end(process, 60) != 0
  found = _parts(tmp_path)
  assert "t.json" in found and found["t.json"][0] >= 3, found
