"""The native engine's sums cut into segments (jdist/collectives/native).

Small segments make every sum here cross processes in several pieces, with
uneven last pieces and per-process chunks; the results must equal a sum
computed on the host from each replica's known input. In one process (1x4)
the same sums run on the local route, which must agree too.
"""

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdist
from jdist import collectives
from jdist.collectives import native

SIZES = (1, 1001, 4099)
DTYPES = (jnp.float32, jnp.int32, jnp.bfloat16, jnp.float16)


def _replica_values(replica, count, dtype):
  """Replica `replica`'s input: small integers, so every sum is exact in 16 bits."""
  values = (np.arange(count) * (replica + 3)) % 11 + replica
  return values.astype(np.float32).astype(dtype)


@contextlib.contextmanager
def _segments_of(nbytes):
  """Native sums cut into `nbytes` segments inside (nothing to set on other routes)."""
  if collectives.route() != "native":
    yield
    return
  previous = native.set_segment_bytes(nbytes)
  try:
    yield
  finally:
    native.set_segment_bytes(previous)


@pytest.mark.parametrize("segment_bytes", [64, 1000])
def test_segmented_sums_equal_the_host_sum(topo, segment_bytes):
  inputs = {f"{np.dtype(dtype).name}_{count}": np.stack(
      [_replica_values(replica, count, dtype) for replica in topo.replica_indices])
            for dtype in DTYPES for count in SIZES}
  expected = {name: sum(_replica_values(replica, value.shape[1], value.dtype).astype(np.float64)
                        for replica in range(topo.replica_count))
              for name, value in inputs.items()}
  # One exchange per leaf (no fusion into one buffer), so every size crosses.
  step = jdist.data_parallel(lambda tree: {k: jdist.psum(v) for k, v in tree.items()})
  before = native.segments_completed()
  with _segments_of(segment_bytes):
    # Waited for inside: the steps are asynchronous, and the segment size
    # must not change while this one's exchanges are being cut.
    summed = jax.block_until_ready(step(inputs))
  for name, value in summed.items():
    assert value.dtype == inputs[name].dtype, name
    for device in range(topo.local_device_count):
      np.testing.assert_array_equal(np.asarray(value[device], np.float64), expected[name],
                                    err_msg=name)
  if collectives.route() == "native":
    # Wire bytes / segment_bytes pieces per sum: at least one, at most 64 and
    # at most one per element.
    pieces = sum(min(64, value.shape[1],
                     max(1, -(-value.nbytes // topo.local_device_count // segment_bytes)))
                 for value in inputs.values())
    assert native.segments_completed() - before == pieces


def test_set_segment_bytes_returns_the_previous_value():
  if not os.path.exists(native.CPU_LIBRARY):
    with pytest.raises(OSError, match="not built"):
      native.set_segment_bytes(1 << 20)
    return
  first = native.set_segment_bytes(12345)
  try:
    assert native.set_segment_bytes(first) == 12345
    native.set_segment_bytes(None)  # the default (by the groups a sum crosses in)
    assert native.set_segment_bytes(0) is None
    assert native.set_segment_bytes(-5) == 0  # negative: the default again
    assert native.set_segment_bytes(first) is None
  finally:
    native.set_segment_bytes(first)
