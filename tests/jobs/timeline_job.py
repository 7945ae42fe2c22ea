"""A small data-parallel loop under `jdist.timeline`, for tests/test_timeline.py.

Run under mpirun. Every rank runs `--steps` steps of a pmean inside
`with jdist.timeline(PATH)`. Faults:

  --stall STEP   rank 1 sleeps 60 s before step STEP: the watchdog (deadline
                 `--timeout`) aborts the job, and every rank's part of the
                 trace must still be written
  --slow S       every step sleeps S seconds on the host (a run long enough
                 to interrupt with SIGINT)

Prints "jdist-job: rank R step N at T" on stderr before each step.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp

import jdist


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("path")
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--stall", type=int, default=0)
  parser.add_argument("--slow", type=float, default=0.0)
  parser.add_argument("--timeout", type=float, default=60.0)
  args = parser.parse_args(argv)
  topo = jdist.init(timeout=args.timeout)

  @jdist.data_parallel
  def step(x):
    return jdist.pmean(x * 2.0)

  x = jnp.ones((jax.local_device_count(), 256))
  with jdist.timeline(args.path):
    for number in range(1, args.steps + 1):
      print(f"jdist-job: rank {topo.process_index} step {number} at {time.time():.3f}",
            file=sys.stderr, flush=True)
      if number == args.stall and topo.process_index == 1:
        time.sleep(60)
      x = step(x) / 2.0
      jax.block_until_ready(x)
      time.sleep(args.slow)
  print("jdist-job: done", flush=True)


if __name__ == "__main__":
  main()
