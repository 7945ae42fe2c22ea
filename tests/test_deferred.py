"""Sums started in one step and finished in a later one (jdist.collectives.deferred).

Under mpirun (2x1, 2x2) on the native route: each finish returns the sum its
token names, with two exchanges of one ordinal in flight, in FIFO order or
by token; a finish of a token never started is an error, not a hang. In one
process (1x4) there is no native route: `applies()` is False in a step, and
`jdist.diloco(delay=τ)` keeps its in-step exchange (tests/test_diloco.py
checks both paths against the same reference).
"""

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist.collectives import deferred
from tests import launch

JOB = [sys.executable, os.path.join(launch.REPO, "tests", "jobs", "deferred_errors.py")]

SIZE = 1001


def _values(replica, seed):
  return ((np.arange(SIZE) * (replica + seed)) % 13 + replica).astype(np.float32)


def _inputs(topo, seed):
  return np.stack([_values(r, seed) for r in topo.replica_indices])


def _expected(topo, seed):
  return sum(_values(r, seed) for r in range(topo.replica_count))


def _check(topo, result, seed):
  for device in range(topo.local_device_count):
    np.testing.assert_array_equal(np.asarray(result[device]), _expected(topo, seed))


def _native(topo):
  applies = jdist.data_parallel(lambda x: jnp.full_like(x, float(deferred.applies())))
  on = bool(np.asarray(applies(np.zeros((topo.local_device_count, 1), np.float32))).all())
  assert on == (jdist.collectives.route() == "native")
  if not on and topo.process_count > 1:
    pytest.fail("the native route is not running across processes: build it with "
                "`python -m jdist.collectives.native.build` (scripts/install.sh does)")
  if not on:
    pytest.skip("deferred exchanges cross processes: the mpirun sessions run this")
  return on


_start = jdist.data_parallel(deferred.start)
_finish = jdist.data_parallel(
    lambda token: deferred.finish(token, jax.ShapeDtypeStruct((SIZE,), jnp.float32)))


def _oldest(token):
  return token.at[:, 1].set(-1)  # seq -1: the oldest exchange of the ordinal not yet read


def test_two_in_flight_finish_first_in_first_out(topo):
  _native(topo)
  deferred.drain()
  first, second = jax.block_until_ready((_start(_inputs(topo, 3)), _start(_inputs(topo, 5))))
  assert deferred.outstanding() == 2 * topo.local_device_count
  _check(topo, _finish(_oldest(first)), 3)
  _check(topo, _finish(_oldest(first)), 5)
  assert deferred.outstanding() == 0
  del second  # read by the second finish (a third would find none: tests/jobs/deferred_errors.py)


def test_finish_by_token_in_any_order_and_again(topo):
  _native(topo)
  deferred.drain()
  first, second = _start(_inputs(topo, 2)), _start(_inputs(topo, 7))
  assert np.all(np.asarray(first)[:, 1] + 1 == np.asarray(second)[:, 1])
  _check(topo, _finish(second), 7)
  _check(topo, _finish(first), 2)
  # Kept until the next start of the ordinal: a state restored and continued
  # beside the original reads the same sum.
  _check(topo, _finish(first), 2)
  assert deferred.drain() == 0


def test_finish_without_start_is_an_error_not_a_hang_subprocess():
  # In a job of its own (tests/jobs/deferred_errors.py), 2 x 2: a failed step's
  # error would come back in later steps of this session.
  result = launch.mpirun(JOB, np=2, env=launch.clean_env(2), timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
  assert sorted(row["rank"] for row in rows) == [0, 1], result.stdout + result.stderr[-3000:]
  for row in rows:
    assert row["route"] == "native"
    assert re.search(r"exchange 4321 \(call 0\) on device \d, which was never started",
                     row["never_started"]), row
    assert "asks for 12 bytes; its start sent 32" in row["wrong_size"], row
    assert row["sum"] == 4.0  # the failed finish read nothing: the sum is still there
    assert re.search(r"\(call -1\).*never started", row["none_left"]), row


def test_an_exchange_of_another_step_passes_one_in_flight(topo):
  # A deferred sum stays in flight while other steps run their own exchanges,
  # whose ordinals count from 0 in every step: the deferred ones take
  # ordinals of their own (`deferred.ORDINAL_BASE` up), or two exchanges
  # with one MPI tag would be on the wire at once and could pair with each
  # other's messages (seen: a DiLoCo sum in flight across an evaluation's
  # parameter mean, "rank 0 sent 10020 bytes where 862160 were expected").
  _native(topo)
  deferred.drain()
  other = jdist.data_parallel(lambda x: jdist.collectives.psum(x))
  small = np.ones((topo.local_device_count, 7), np.float32)
  for seed in range(4):
    token = _start(_inputs(topo, seed))
    assert np.all(np.asarray(token)[:, 0] >= deferred.ORDINAL_BASE)
    np.testing.assert_array_equal(np.asarray(other(small)), topo.replica_count)
    _check(topo, _finish(token), seed)
  assert deferred.drain() == 0
