"""`jdist train --shrink` where one rank dies, for tests/test_fault_shrink.py.

Usage (under `jdist launch --shrink`): shrink_faults.py RANK STEP -- FLAGS...
Rank RANK (its launch rank) exits with os._exit(1) before global step STEP,
as a killed process would: no MPI_Finalize, no goodbye. It prints
"jdist-job: rank R dies at <unix time>" on stderr first. Every survivor
prints "jdist-job: rank R digest D" at the end (replicas must agree).
"""

import os
import sys
import time


def main(argv):
  victim, at_step = int(argv[0]), int(argv[1])
  flags = argv[3:] if argv[2:3] == ["--"] else argv[2:]
  from jdist.app import cli  # pylint: disable=import-outside-toplevel
  from jdist.app import train_shrink  # pylint: disable=import-outside-toplevel

  def on_step(step, rank):
    if rank == victim and step == at_step:
      print(f"jdist-job: rank {rank} dies at {time.time():.3f}", file=sys.stderr, flush=True)
      os._exit(1)  # pylint: disable=protected-access

  config, _ = cli.parse_train_args(flags)
  summary = train_shrink.train(config, on_step=on_step)
  rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
  print(f"jdist-job: rank {rank} digest {summary['params_digest']}", file=sys.stderr, flush=True)
  train_shrink.leave(summary)  # no MPI_Finalize after a shrink: it would wait for the dead rank
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
