"""Sums of odd sizes and every summed dtype, for tests/test_hierarchy.py.

Run under mpirun (one host, or the cluster rig). Each replica sums its own
known input through `jdist.psum` in a `jdist.data_parallel` step (one
exchange per buffer); every rank checks the result against numpy's sum of
every replica's input and prints one JSON line:

  {"rank", "route", "hierarchical", "segments", "failures", "digest"}

`failures` lists the buffers that disagree; `digest` hashes every result, so
the test can check that all ranks got the same bytes. Where the sums are
node-aware, the same step runs again switched to flat sums
(`native.set_hierarchical(False)`): "flat_failures", "flat_digest",
"flat_segments", "flat_after_switch".
"""

import hashlib
import json

import jax
import numpy as np
from jax import numpy as jnp

import jdist
from jdist import collectives
from jdist.collectives import native

SIZES = (1, 3, 1001, 4099, 65537, 300001)  # the last: several default node-aware segments
DTYPES = (np.float32, jnp.bfloat16, np.float16, np.int32)
# One rounding per sum level (process, node, across nodes): a few 16-bit ulps.
RTOL = {np.dtype(np.float32): 1e-5, np.dtype(jnp.bfloat16): 3 * 2.0**-8,
        np.dtype(np.float16): 3 * 2.0**-11, np.dtype(np.int32): 0.0}


def replica_input(replica: int, count: int, dtype) -> np.ndarray:
  """Replica `replica`'s buffer: positive, so sums round without cancelling."""
  rng = np.random.default_rng(1000 * replica + count)
  if np.dtype(dtype) == np.int32:
    return rng.integers(-1000, 1000, count).astype(np.int32)
  return rng.uniform(0.5, 2.0, count).astype(np.float32).astype(dtype)


def check(step, inputs, topo) -> tuple[list[str], str, int]:
  """Runs `step` once; returns the buffers that disagree with numpy, a digest
  of every result, and the segments the sums crossed in."""
  before = native.segments_completed()
  summed = jax.block_until_ready(step(inputs))
  failures, digest = [], hashlib.sha256()
  for name in sorted(summed):
    value = np.asarray(summed[name])
    dtype, count = inputs[name].dtype, inputs[name].shape[1]
    expected = sum(replica_input(r, count, dtype).astype(np.float64)
                   for r in range(topo.replica_count))
    ok = value.dtype == dtype and all(
        np.allclose(value[d].astype(np.float64), expected, rtol=RTOL[dtype], atol=0)
        for d in range(value.shape[0]))
    if not ok:
      worst = np.max(np.abs(value.astype(np.float64) - expected) / np.abs(expected).clip(1))
      failures.append(f"{name}: worst relative error {worst:.3g}")
    digest.update(value.tobytes())
  return failures, digest.hexdigest(), native.segments_completed() - before


def main():
  topo = jdist.init()
  inputs = {f"{np.dtype(d).name}_{n}": np.stack([replica_input(r, n, d)
                                                  for r in topo.replica_indices])
            for d in DTYPES for n in SIZES}
  step = jdist.data_parallel(lambda tree: {k: jdist.psum(v) for k, v in tree.items()})
  hierarchical = native.hierarchical()
  failures, digest, segments = check(step, inputs, topo)
  row = {"rank": topo.process_index, "route": collectives.route(),
         "hierarchical": hierarchical, "segments": segments, "failures": failures,
         "digest": digest}
  if hierarchical:  # the same sums switched to flat, and back
    native.set_hierarchical(False)
    row["flat_failures"], row["flat_digest"], row["flat_segments"] = check(step, inputs, topo)
    row["flat_after_switch"] = not native.hierarchical()
    native.set_hierarchical(True)
  print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
