"""The flight recorder and the first exchange the ranks disagree on.

Unit tests on fabricated recorder contents (`flight_report`), and of the
recorder's own bookkeeping (`flight_recorder`). The hang tests of
tests/test_watchdog.py check the recorder's section in real abort reports.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.compression import half
from jdist.compression import protocol
from jdist.compression import qsgd
from jdist.compression import sparse
from jdist.runtime import flight_recorder
from jdist.runtime import flight_report


@pytest.fixture(autouse=True)
def _fresh_recorder():
  # Without the engine's ring: under mpirun it holds the session's earlier exchanges.
  sources = flight_recorder.detach_sources()
  flight_recorder.reset()
  yield
  flight_recorder.reset()
  for source in sources:
    flight_recorder.add_source(source)


def _row(ordinal, call, state, age, kind="sum", nbytes=4096, label=""):
  return {"ordinal": ordinal, "call": call, "kind": kind, "nbytes": nbytes, "state": state,
          "age_s": age, "label": label or f"allreduce: {kind}"}


def _steps(calls, ordinals=3, last_state="done", age=20.0):
  """A rank that ran `calls` steps of `ordinals` exchanges; the last call in `last_state`."""
  rows = []
  for call in range(calls):
    for ordinal in range(ordinals):
      state = last_state if call == calls - 1 else "done"
      rows.append(_row(ordinal, call, state, age - call - ordinal / 10))
  return {"entries": rows, "progress": {o: calls - 1 for o in range(ordinals)}, "host": 2}


def test_a_rank_that_stopped_early_never_posted_the_exchange_the_others_wait_in():
  # Ranks 0 and 2 posted step 5's exchanges (call 4); rank 1 finished 4 steps.
  recorders = {0: _steps(5, last_state="wire"), 1: _steps(4), 2: _steps(5, last_state="wire")}
  found = flight_report.first_divergence(recorders)
  assert found["key"] == ("step", 0, 4)  # the oldest of the exchanges rank 1 never posted
  assert found["never"] == [1]
  assert found["states"] == {0: "wire", 1: "never", 2: "wire"}
  text = flight_report.describe(recorders, size=3)
  assert "first disagree at exchange ordinal 0 (call 4, allreduce: sum, 4,096 B)" in text
  assert "posted by rank 0 (wire), rank 2 (wire); never posted by rank(s) 1." in text
  assert "rank 1 last exchanges (ordinal.call): #2.2 sum done, #0.3 sum done" in text


def test_entries_evicted_from_a_ring_count_as_posted_by_progress():
  # Rank 1's ring holds only the last call, but its progress shows it passed the others.
  behind = _steps(6)
  behind["entries"] = [row for row in behind["entries"] if row["call"] >= 5]
  recorders = {0: _steps(6), 1: behind}
  assert flight_report.first_divergence(recorders) is None
  assert "every recorded exchange finished" in flight_report.describe(recorders)


def test_every_rank_posted_but_the_exchange_did_not_finish():
  recorders = {0: _steps(3, last_state="wire"), 1: _steps(3, last_state="posted")}
  found = flight_report.first_divergence(recorders)
  assert found["key"] == ("step", 0, 2) and found["never"] == []
  assert "every rank posted it, and it did not finish" in flight_report.describe(recorders)


def test_host_exchanges_are_compared_by_their_count():
  waiting = {"entries": [_row(6, 0, "done", 9.0, kind="host", nbytes=0, label="jdist.barrier"),
                         _row(7, 0, "wire", 5.0, kind="host", nbytes=0, label="jdist.barrier")],
             "progress": {}, "host": 7}
  late = {"entries": [_row(6, 0, "done", 9.0, kind="host", nbytes=0, label="jdist.barrier")],
          "progress": {}, "host": 6}
  found = flight_report.first_divergence({0: waiting, 1: late})
  assert found["key"] == ("host", 7) and found["never"] == [1]
  assert "host exchange 7 (jdist.barrier)" in flight_report.describe({0: waiting, 1: late})


def test_a_silent_rank_is_named_and_nothing_recorded_says_nothing():
  text = flight_report.describe({0: _steps(2, last_state="wire")}, size=2)
  assert "no recorder from rank(s) 1" in text
  assert flight_report.describe({0: {"entries": [], "progress": {}, "host": 0}}) == ""


def test_callback_devices_make_one_entry_done_when_the_last_device_leaves():
  keys = [flight_recorder.device_posted(d, 3, "sum", 64, devices=2) for d in (0, 1)]
  assert keys[0] == keys[1] == (3, 0)
  flight_recorder.device_done(keys[0])
  (entry,) = flight_recorder.snapshot()
  assert (entry.ordinal, entry.call, entry.state) == (3, 0, "wire")
  flight_recorder.device_done(keys[1])
  assert flight_recorder.snapshot()[0].state == "done"
  assert flight_recorder.device_posted(0, 3, "sum", 64, devices=2) == (3, 1)  # the next call
  summary = flight_recorder.summary()
  assert summary["progress"] == {3: 1} and len(summary["entries"]) == 2


def test_trace_level_steps_and_host_exchanges():
  # The mpi4jax route: traced exchanges are posted at dispatch, done at the step's end.
  flight_recorder.note_traced("mpi4jax", "sum", 0, 40, "train_step")
  flight_recorder.note_traced("native", "sum", 1, 40, "train_step")  # records itself
  flight_recorder.step_dispatched(1, "train_step", 100)
  (entry,) = flight_recorder.snapshot()
  assert (entry.ordinal, entry.call, entry.state, entry.route) == (0, 0, "posted", "mpi4jax")
  assert entry.label == "psum/pmean: dense sum"
  flight_recorder.step_done(1, 100, 200)
  assert flight_recorder.snapshot()[0].state == "done"
  host = flight_recorder.host_posted(4, "jdist.barrier")
  assert flight_recorder.summary()["host"] == 4
  flight_recorder.host_done(host)
  assert flight_recorder.snapshot()[-1].state == "done"


def test_labels_name_the_schemes_that_traced_the_exchange():
  with flight_recorder.scheme("DiLoCo"), flight_recorder.scheme("16-bit"):
    assert flight_recorder.scheme_label("sum16") == "DiLoCo / 16-bit: 16-bit sum"
    with flight_recorder.scheme("DiLoCo"):  # a scheme named twice reads once
      assert flight_recorder.scheme_label("sum") == "DiLoCo / 16-bit: dense sum"
  assert flight_recorder.scheme_label("gather") == "psum/pmean: gather"


@jax.tree_util.register_pytree_node_class
class _Probe(protocol.WirePayload):
  """A payload that notes the label its exchange would carry."""

  SCHEME = "probe"
  labels: list = []

  def __init__(self, tree):
    self.tree = tree

  def tree_flatten(self):
    return (self.tree,), None

  @classmethod
  def tree_unflatten(cls, _, children):
    return cls(*children)

  def reduce_over_replicas(self, exchange, factor):
    _Probe.labels.append(flight_recorder.scheme_label("sum"))
    return jax.tree.map(lambda x: x * factor, exchange.sum(self.tree))


def test_a_payloads_exchange_is_named_by_the_transformation_and_the_payload():
  probe = optax.GradientTransformation(lambda p: optax.EmptyState(),
                                       lambda u, s, p=None: (_Probe(u), s))
  tx = optax.chain(probe, jdist.allreduce())
  params = {"w": jnp.arange(8.0)}
  step = jdist.data_parallel(lambda g, s: tx.update(g, s)[0])
  _Probe.labels.clear()
  out = step(jdist.replicate(params), jdist.replicate(tx.init(params)))
  np.testing.assert_allclose(jdist.unreplicate(out)["w"], params["w"])
  assert _Probe.labels == ["allreduce / probe: dense sum"]
  assert [cls.SCHEME for cls in (half.HalfPayload, sparse.SparsePayload, qsgd.QSGDPayload)] == [
      "16-bit", "sparse", "QSGD"]


def test_the_ring_keeps_the_last_slots():
  for number in range(flight_recorder.SLOTS + 10):
    flight_recorder.host_done(flight_recorder.host_posted(number + 1, "jdist.barrier"))
  entries = flight_recorder.snapshot()
  assert len(entries) == flight_recorder.SLOTS
  assert entries[0].ordinal == 11 and entries[-1].ordinal == flight_recorder.SLOTS + 10


def test_switched_off_it_records_nothing_but_still_serves_listeners():
  seen = []

  class Listener:
    def step_dispatched(self, number, name, at_ns, call):
      seen.append(("dispatched", number, call))

    def step_done(self, number, start_ns, done_ns):
      seen.append(("done", number))

  flight_recorder.add_listener(Listener())
  assert flight_recorder.set_enabled(False) is True  # on by default (JDIST_FLIGHT_RECORDER)
  try:
    key = flight_recorder.device_posted(0, 0, "sum", 64, devices=1)
    flight_recorder.device_done(key)
    flight_recorder.host_done(flight_recorder.host_posted(1, "barrier"))
    flight_recorder.step_dispatched(1, "train_step", 0, 1)
    flight_recorder.step_done(1, 0, 10)
    assert flight_recorder.snapshot() == [] and flight_recorder.summary()["host"] == 0
  finally:
    assert flight_recorder.set_enabled(True) is False
  assert seen == [("dispatched", 1, 1), ("done", 1)]
  flight_recorder.device_done(flight_recorder.device_posted(0, 0, "sum", 64, devices=1))
  assert [e.state for e in flight_recorder.snapshot()] == ["done"]


def test_exchanges_done_since_a_time_include_one_that_finished_while_they_were_read(
    monkeypatch):
  # jdist.timeline takes the exchanges done after the newest it took. Reading
  # live entries, it could see exchange 1 done but not exchange 0, which
  # finished while it read, and then skip exchange 0 for good (CI, stop 45).
  created = []

  class Entry(flight_recorder.Entry):
    """An entry whose first read lets the exchanges in flight finish (on another thread)."""
    on_read = None

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      created.append(self)

    @property
    def state(self):
      value, hook, self.on_read = self._state, self.on_read, None
      if hook is not None:  # the recorder's lock may be held: do not wait for it forever
        finisher = threading.Thread(target=hook)
        finisher.start()
        finisher.join(timeout=0.5)
      return value

    @state.setter
    def state(self, value):
      self._state = value

  monkeypatch.setattr(flight_recorder, "Entry", Entry)
  # Device 0 leaves exchange 0 and enters exchange 1 before device 1 leaves 0.
  first = flight_recorder.device_posted(0, 0, "sum", 64, devices=2)
  flight_recorder.device_posted(1, 0, "sum", 64, devices=2)
  flight_recorder.device_done(first)
  second = flight_recorder.device_posted(0, 0, "sum", 64, devices=2)

  def device_1_finishes_both():
    flight_recorder.device_done(first)
    flight_recorder.device_done(flight_recorder.device_posted(1, 0, "sum", 64, devices=2))
    flight_recorder.device_done(second)

  created[0].on_read = device_1_finishes_both
  seen_ns, taken = 0, []
  deadline = time.monotonic() + 10
  while len(taken) < 2 and time.monotonic() < deadline:  # until the finisher has run
    for entry in flight_recorder.done_since(seen_ns):
      taken.append(entry.call)
      seen_ns = max(seen_ns, entry.done_ns)
    time.sleep(0.001)
  assert taken == [0, 1]
