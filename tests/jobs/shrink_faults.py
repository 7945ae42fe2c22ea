"""`jdist train --shrink` where one rank dies, for tests/test_fault_shrink.py.

Usage (under `jdist launch --shrink`): shrink_faults.py RANK STEP [DELAY] -- FLAGS...
Rank RANK (its launch rank) exits with os._exit(1) before global step STEP,
as a killed process would: no MPI_Finalize, no goodbye; with DELAY, it
SIGKILLs itself DELAY seconds into that step instead (mid-step: in the
gradient or in the allreduce). It prints
"jdist-job: rank R dies at <unix time>" on stderr first. Every survivor
prints "jdist-job: rank R digest D" at the end (replicas must agree), R its
launch rank (processes started to grow the job back have ranks above -np's),
and writes D to LOG.digest.R beside the run's --log-file LOG: mpirun may end
before it forwards a survivor's last line, a file is always there.
Faults happen in the launch's first run only (not after a `--max-restarts`
restart). With JDIST_TEST_SLOW_UNTIL_REPLICAS=N, steps on fewer than N
replicas wait 0.5 s each.
"""

import os
import signal
import sys
import threading
import time

# Set: a process that the survivors start to grow back dies before it joins
# them, as one killed while starting would.
JOINER_DIES_ENV = "JDIST_TEST_JOINER_DIES"
# Set to N: while fewer than N replicas train, each step waits 0.5 s first, so
# that the run cannot end before a started process is ready, however slowly
# the machine starts it.
SLOW_UNTIL_ENV = "JDIST_TEST_SLOW_UNTIL_REPLICAS"


def main(argv):
  victim, at_step, rest = int(argv[0]), int(argv[1]), argv[2:]
  delay = None
  if rest and rest[0] != "--":
    delay, rest = float(rest[0]), rest[1:]
  flags = rest[1:] if rest[:1] == ["--"] else rest
  from jdist.app import cli  # pylint: disable=import-outside-toplevel
  from jdist.app import train_shrink  # pylint: disable=import-outside-toplevel

  first_run = os.environ.get("JDIST_RESTART", "0") == "0"  # jdist launch --max-restarts

  slow_until = int(os.environ.get(SLOW_UNTIL_ENV, "0"))

  def on_step(step, rank, replicas):
    if replicas < slow_until:
      time.sleep(0.5)
    if rank == victim and step == at_step and first_run:
      print(f"jdist-job: rank {rank} dies at {time.time():.3f}", file=sys.stderr, flush=True)
      if delay is None:
        os._exit(1)  # pylint: disable=protected-access
      threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()

  if os.environ.get(JOINER_DIES_ENV) and train_shrink.shrinkable.spawned():
    print(f"jdist-job: a started process dies before joining at {time.time():.3f}",
          file=sys.stderr, flush=True)
    os._exit(1)  # pylint: disable=protected-access
  config, _ = cli.parse_train_args(flags)
  summary = train_shrink.train(config, on_step=on_step)
  rank = summary["launch_rank"]  # a process the job started later has a rank of its own
  print(f"jdist-job: rank {rank} digest {summary['params_digest']}", file=sys.stderr, flush=True)
  if config.log_file:
    with open(f"{config.log_file}.digest.{rank}", "w", encoding="utf-8") as out:
      out.write(summary["params_digest"])
  train_shrink.leave(summary)  # no MPI_Finalize after a shrink: it would wait for the dead rank
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
