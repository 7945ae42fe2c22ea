"""Two ranks calling different jdist host collectives: the job must end with a report.

Run under mpirun by tests/test_diverged_host.py. Rank 0 asks a
`jdist.CheckpointManager` for its newest step inside `if topo.is_primary:`
(a host collective called on one rank only), while every other rank goes on
to the collective after it, `--then` (`barrier`, `broadcast` for
`jdist.broadcast_params`, `allreduce` for `jdist.host_allreduce`). The job
must end with the report naming both ranks and both calls, well before the
watchdog's deadline (`--timeout`).

Lines on stderr: "jdist-job: rank R diverging at <unix time>" just before
the collectives; "jdist-job: done" if the job went on (it must not).
"""

import argparse
import sys
import tempfile
import time

import jax.numpy as jnp

import jdist

THEN = ("barrier", "broadcast", "allreduce")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--timeout", type=float, default=60.0)
  parser.add_argument("--then", choices=THEN, default="barrier")
  parser.add_argument("--directory", default=None)
  args = parser.parse_args()
  topo = jdist.init(timeout=args.timeout)
  directory = args.directory or tempfile.mkdtemp(prefix="jdist-diverged-")
  manager = jdist.CheckpointManager(directory)
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  jdist.barrier()  # every rank is up
  sys.stderr.write(f"jdist-job: rank {topo.process_index} diverging at {time.time()}\n")
  sys.stderr.flush()
  if topo.is_primary:
    manager.latest_step()  # rank 0 only: the mistake
  if args.then == "barrier":
    jdist.barrier()
  elif args.then == "broadcast":
    jdist.broadcast_params(params)
  else:
    jdist.host_allreduce({"loss": 1.0})
  if topo.is_primary:
    print("jdist-job: done", flush=True)


if __name__ == "__main__":
  main()
