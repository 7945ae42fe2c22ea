"""Deferred sums that must fail clearly (tests/test_deferred.py runs it under mpirun).

Each rank finishes a token never started, then one asking for another size,
then the oldest unread one where none is left; each must raise an error
naming the exchange (not hang). A failed step's error stays with JAX's and
jdist's bookkeeping of later steps, so these run in a job of their own.
Prints one JSON line per rank: the errors' messages.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jdist  # noqa: E402
from jdist.collectives import deferred  # noqa: E402


def _error(step, *args) -> str:
  try:
    jax.block_until_ready(step(*args))
  except Exception as err:  # pylint: disable=broad-except
    return str(err)
  return ""


def main():
  topo = jdist.init()
  devices = topo.local_device_count
  finish = lambda size: jdist.data_parallel(  # noqa: E731
      lambda token: deferred.finish(token, jax.ShapeDtypeStruct((size,), jnp.float32)))
  start = jdist.data_parallel(deferred.start)
  never = np.tile(np.asarray([[4321, 0, 1]], np.int32), (devices, 1))
  errors = {"never_started": _error(finish(8), never)}
  token = jax.block_until_ready(start(np.ones((devices, 8), np.float32)))
  errors["wrong_size"] = _error(finish(3), token)
  errors["sum"] = np.asarray(finish(8)(token)).tolist()[0][0]
  errors["none_left"] = _error(finish(8), np.asarray(token).copy() * [1, 0, 1] - [0, 1, 0])
  errors["route"] = jdist.collectives.route()
  print(json.dumps({"rank": topo.process_index, **errors}), flush=True)
  # JAX keeps each device's last error for its exit, and jdist waits for every
  # step 8 steps later: a few good steps on every device replace them, so the
  # job ends cleanly.
  roundtrip = jdist.data_parallel(
      lambda x: deferred.finish(deferred.start(x), jax.ShapeDtypeStruct((8,), jnp.float32)))
  for _ in range(jdist.parallel.MAX_INFLIGHT_STEPS + 2):
    _error(roundtrip, np.ones((devices, 8), np.float32))
  jax.effects_barrier()


if __name__ == "__main__":
  main()
