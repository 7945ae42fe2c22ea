"""DiLoCo's outer sync in the background (jdist.transforms.diloco_background).

On the native route (2x1, 2x2) a fragment's exchange is started at its sync
step and read τ steps later: the state's `in_flight` holds its token in
between, and the replicas still match the K-worker reference of
tests/test_diloco.py (the same math as the in-step exchange). In one process
(1x4) the exchange runs inside its step and `in_flight` stays zero; the same
reference is checked. Checkpoint, resume and the end of training are tested
here too: a state saved with an exchange in flight, restored, continues
as the original did, its exchange redone from the shares it holds (the sum
was dropped once the original went on, or the checkpoint names another
run); an exchange left in flight at the end is dropped without a hang.
"""


import tempfile

import jax
import numpy as np
import optax
import pytest

import jdist
from jdist.collectives import deferred
from tests import reference
from tests.test_diloco import PER_REPLICA, _check_replicas, _setup, reference_diloco

# Fragment 0 syncs at steps 2, 6, ..., fragment 1 at 4, 8, ...; each is applied
# 3 steps later, so at step 4 both fragments' exchanges are in flight.
SETTINGS = dict(sync_every=4, fragments=2, delay=3, mix=0.5)
STEPS = 9


def _run(topo, tx, model, replicated, state, batches, first, last):
  step = jdist.data_parallel(reference.train_step_fn(model, tx))
  flights = []
  for i in range(first, last):
    x, y = (reference.local_slices(a, topo, PER_REPLICA) for a in batches[i % len(batches)])
    replicated, state = step(replicated, state, x, y)
    flights.append(np.asarray(state.in_flight)[0])  # device 0's tokens after step i + 1
  return replicated, state, flights


def test_background_sync_matches_the_delayed_reference(topo):
  model, params, batches = _setup(topo, seed=6)
  inner, outer = optax.adam(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True)
  tx = jdist.diloco(inner, outer=outer, **SETTINGS)
  replicated = jdist.replicate(params)
  state = jdist.data_parallel(tx.init)(replicated)
  replicated, state, flights = _run(topo, tx, model, replicated, state, batches, 0, STEPS)
  workers, outer_params, _ = reference_diloco(model, params, inner, outer, batches, STEPS,
                                              topo.replica_count, **SETTINGS)
  _check_replicas(topo, replicated, workers, atol=1e-5)
  for device in range(topo.local_device_count):
    reference.assert_trees_close(jax.tree.map(lambda x: x[device], state.outer_params),
                                 outer_params, atol=1e-5)
  sessions = np.asarray([flight[:, 2] for flight in flights])  # [step, fragment]
  if jdist.collectives.route() != "native":
    assert not sessions.any()  # exchanged inside the sync step
    return
  # In flight from each sync step (2, 6: fragment 0; 4, 8: fragment 1) until
  # its apply step (5, 9; 7), then cleared.
  in_flight = sessions != 0
  expected = np.zeros_like(in_flight)
  for sync, fragment in ((2, 0), (6, 0), (4, 1), (8, 1)):
    expected[sync - 1:sync - 1 + SETTINGS["delay"], fragment] = True
  np.testing.assert_array_equal(in_flight, expected)
  assert in_flight[3].all()  # after step 4: both fragments' exchanges on the wire
  assert len(set(sessions[in_flight].tolist())) == 1
  # Training stops with fragment 1's exchange of step 8 in flight: it
  # completes on the wire and is dropped (no process waits for it).
  assert in_flight[-1].tolist() == [False, True]
  assert deferred.drain() >= topo.local_device_count


@pytest.mark.parametrize("payload", [None, "sparse:0.1"])
def test_checkpoint_with_an_exchange_in_flight_resumes_exactly(topo, payload):
  """A sparse payload's exchange is redone as a sum of the decoded shares."""
  model, params, batches = _setup(topo, seed=7)
  tx = jdist.diloco(optax.adam(1e-2), payload=payload, **SETTINGS)
  replicated = jdist.replicate(params)
  state = jdist.data_parallel(tx.init)(replicated)
  replicated, state, _ = _run(topo, tx, model, replicated, state, batches, 0, 4)
  native = jdist.collectives.route() == "native"
  assert bool(np.asarray(state.in_flight)[..., 2].all()) == native
  restored = reference.checkpoint_round_trip(topo, {"params": replicated, "opt_state": state})
  # The same state as if saved by another run: its tokens name another session.
  # Each copy runs after the one before: once the original read a sum and
  # started that fragment's next exchange, the sum is dropped, so both
  # copies redo their exchanges from the shares `pending` holds.
  flight = np.asarray(restored["opt_state"].in_flight)
  other_run = restored["opt_state"]._replace(in_flight=jdist.replicate(
      np.where(flight[0] != 0, flight[0] * [1, 1, 0] + [0, 0, 1 << 30], 0)))
  runs = {name: _run(topo, tx, model, p, s, batches, 4, 8)[:2] for name, (p, s) in {
      "original": (replicated, state), "restored": (restored["params"], restored["opt_state"]),
      "other_run": (restored["params"], other_run)}.items()}
  def values(run):  # all but the tokens' call counts, which each copy's starts take anew
    params, state = run
    return params, state._replace(in_flight=np.asarray(state.in_flight)[..., ::2])

  for name in ("restored", "other_run"):
    for a, b in zip(jax.tree.leaves(values(runs["original"])),
                    jax.tree.leaves(values(runs[name]))):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6,
                                 err_msg=name)
  deferred.drain()


def test_jdist_train_diloco_delay_reaches_the_state(topo, capsys):
  """`jdist train --diloco-delay/--diloco-mix` build `jdist.diloco(delay=, mix=)`.

  H = 4, 2 fragments: fragment 1 exchanges at step 8, the last, and would be
  applied at step 9, so the run ends with it in flight: on the native route
  (several processes) its token is in the state's `in_flight`, in one
  process the average sits in `pending` (the in-step path).
  """
  from tests.test_diloco import _train  # pylint: disable=import-outside-toplevel
  log = tempfile.mktemp(suffix=".jsonl")
  flags = ("--diloco", "4", "--diloco-fragments", "2")
  plain = _train(topo, log, *flags)
  run = _train(topo, log, *flags, "--diloco-delay", "1", "--diloco-mix", "0.5")
  assert run["config"]["diloco_delay"] == 1 and run["config"]["diloco_mix"] == 0.5
  assert [record["outer_syncs"] for record in run["epochs"]] == [2, 4]
  state = run["state"]["opt_state"]
  assert plain["state"]["opt_state"].in_flight == ()  # delay 0: no such state
  assert np.shape(state.in_flight) == (2,) + deferred.TOKEN_SHAPE
  flight = np.asarray(state.in_flight)
  assert not flight[0].any()  # fragment 0's exchange (step 6) was applied at step 7
  mixed = [np.asarray(leaf) for leaf in jax.tree.leaves(state.pending)]
  if topo.process_count > 1:
    assert flight[1][2] != 0  # started at step 8, a token of this run's session
  else:
    assert not flight.any()
  assert any(np.any(leaf != 0) for leaf in mixed)  # the shares or the average held
  printed = capsys.readouterr().out
  if topo.is_primary:
    assert "applied 1 steps later, mix 0.5" in printed
  differ = [not np.allclose(a, b) for a, b in zip(
      jax.tree.leaves(plain["state"]["params"]), jax.tree.leaves(run["state"]["params"]))]
  assert any(differ)
