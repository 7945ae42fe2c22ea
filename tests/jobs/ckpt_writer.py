"""Writes checkpoints from a world other than the test's (run by test_checkpoint.py).

  python tests/jobs/ckpt_writer.py world DIR   # 1 process x N devices (N from XLA_FLAGS)
      DIR/identical: step 7 of a state equal on every replica (plain dist_opt)
      DIR/per_replica: step 7 of a state whose momentum differs per replica
  python tests/jobs/ckpt_writer.py kill DIR
      saves step 1, then starts saving step 2 and never finishes: the test
      SIGKILLs this process once step 2's temporary directory appears.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jdist
from jdist.checkpoint.manager import CheckpointManager

KILL_LEAF_SIZE = 1 << 22  # 16 MB of float32 per copy: a write that takes a while


def world_state(per_replica: bool):
  """Fixed params and SGD-momentum state; momentum = replica index if per_replica."""
  rng = np.random.default_rng(0)
  params = jdist.replicate({"dense": {"bias": rng.normal(size=4).astype(np.float32),
                                      "kernel": rng.normal(size=(8, 4)).astype(np.float32)}})
  opt_state = jdist.data_parallel(optax.sgd(0.1, momentum=0.9).init)(params)
  if per_replica:
    ids = np.array(jdist.init().replica_indices, np.float32)
    opt_state = jdist.data_parallel(
        lambda s, i: jax.tree.map(lambda x: x + i if x.ndim else x, s))(opt_state, ids)
  return {"params": params, "opt_state": opt_state}


def kill_state(value: float):
  return {"w": jdist.replicate(jnp.full((KILL_LEAF_SIZE,), value, jnp.float32))}


def main(mode: str, directory: str) -> None:
  topo = jdist.init()
  if mode == "world":
    for name, per_replica in (("identical", False), ("per_replica", True)):
      CheckpointManager(f"{directory}/{name}").save(
          7, world_state(per_replica), metadata={"step": 7, "model": "dense"})
    print(f"WROTE {topo.replica_count} replicas", flush=True)
  elif mode == "kill":
    manager = CheckpointManager(directory)
    manager.save(1, kill_state(1.0), metadata={"step": 1})
    print("SAVED 1", flush=True)
    # The kill must land before orbax renames the temporary directory: block
    # the rename, so the test never races a write that finished early.
    from orbax.checkpoint._src.path import atomicity  # pylint: disable=g-import-not-at-top
    import time  # pylint: disable=g-import-not-at-top

    async def never_finalize(self):
      del self
      time.sleep(600)

    atomicity.AtomicRenameTemporaryPath.finalize = never_finalize
    manager.save(2, kill_state(2.0), metadata={"step": 2})
    print("SAVED 2 (the kill came too late)", flush=True)
  else:
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main(*sys.argv[1:])
