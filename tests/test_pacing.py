"""A started (background) sum yields to the steps' own exchanges
(jdist/collectives/native/pacing.h).

Under mpirun (2x1, 2x2) on the native route, without timing: rank 0 starts
a 1 MB sum that rank 1 does not start until rank 0 has checked (a barrier
holds it back), so the sum cannot cross meanwhile. A small in-step sum then
completes on both ranks while at most one 64 KiB segment of the started sum
was handed to MPI (the rest waits in the engine, so nothing of it queues
ahead of the small sum). Once rank 1 starts it too, the started sum crosses
in its 16 segments, one at a time, and its result is exact. Unpaced (the
engine before pacing: `deferred.set_segment_bytes(0)`) all 16 are handed to
MPI at once, ahead of the small sum: the control. In one process
(1x4) there is no native route: the mpirun sessions run this.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist.collectives import deferred
from jdist.collectives import native
from jdist.runtime import job as job_lib
from tests import test_deferred

SEGMENT_BYTES = 64 << 10
SIZE = 250_000  # float32: 1 MB, 16 segments of 64 KiB


def _values(replica):
  return ((np.arange(SIZE) * (replica + 3)) % 17 + replica).astype(np.float32)


_small = jdist.data_parallel(jdist.collectives.psum)
# The small sum first: its ordinal (0) is the in-step programs' own.
_start = jdist.data_parallel(lambda y, x: (jdist.collectives.psum(y), deferred.start(x)))
_finish = jdist.data_parallel(
    lambda token: deferred.finish(token, jax.ShapeDtypeStruct((SIZE,), jnp.float32)))


def _in_flight() -> int:
  return deferred.segments_posted() - native.segments_completed()


@pytest.mark.parametrize("paced", [True, False], ids=["paced", "unpaced"])
def test_small_sum_passes_a_started_sum_held_back_by_its_peer(topo, paced):
  test_deferred._native(topo)  # pylint: disable=protected-access
  deferred.drain()
  segments = -(-SIZE * 4 // SEGMENT_BYTES)
  # Unpaced (background segments 0: the engine before pacing), the started
  # sum's 16 segments of the same size all go to MPI at once.
  previous = (deferred.set_segment_bytes(SEGMENT_BYTES if paced else 0),
              native.set_segment_bytes(SEGMENT_BYTES))
  try:
    ones = np.ones((topo.local_device_count, 1), np.float32)
    big = np.stack([_values(r) for r in topo.replica_indices])
    rank = topo.process_index
    # Traced and compiled alike on every rank first (tracing compares the
    # steps' structure across ranks, in order).
    _finish(_start(ones, big)[1]).block_until_ready()
    _small(ones).block_until_ready()
    assert _in_flight() == 0
    # Each rank runs three programs whose in-step sum is ordinal 0, in an
    # order that pairs them; only rank 0 starts the big sum before the barrier.
    if rank == 0:
      small_before, token = _start(ones, big)
      small = _small(ones)
    else:
      small_before = _small(ones)
      small = _small(ones)
    jax.block_until_ready((small_before, small))
    np.testing.assert_array_equal(np.asarray(small), topo.replica_count)
    # The small sum completed while the started one could not cross: of the
    # latter, paced, one segment was handed to MPI (all of it unpaced).
    assert _in_flight() == (0 if rank else 1 if paced else segments)
    crossed = native.segments_completed()
    job_lib.world().barrier("test_pacing")
    if rank == 0:
      _small(ones)
    else:
      _, token = _start(ones, big)
    result = np.asarray(_finish(token))
    expected = sum(_values(r) for r in range(topo.replica_count))
    for device in range(topo.local_device_count):
      np.testing.assert_array_equal(result[device], expected)
    assert native.segments_completed() - crossed == segments + 1  # and one small sum
    assert _in_flight() == 0
  finally:
    deferred.set_segment_bytes(previous[0])
    native.set_segment_bytes(previous[1])
  assert deferred.drain() == 0
