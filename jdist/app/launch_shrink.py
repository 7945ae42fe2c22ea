"""`jdist launch --shrink`: mpirun with Open MPI's fault tolerance (ULFM) on.

The job runs under `mpirun --with-ft ulfm`, so that a process that dies
does not end the others (`jdist train --shrink` shrinks past it), with:

  * the TCP transport only (`--mca btl tcp,self`): with the shared-memory
    one, survivors on the same node never learn that a peer died (measured:
    an allreduce still waited 118 s after its peer's death, against 10 ms
    over TCP);
  * JAX's distributed runtime off (`JDIST_JAX_DISTRIBUTED=0`): its
    coordination service ends every process when one dies, and all of them
    when process 0 does.

mpirun's exit status is that of the failed processes even when the
survivors completed the run; the status here is 0 once the job's surviving
rank 0 said it finished.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

from jdist.app import supervise as supervise_lib

ULFM_MPIRUN_ARGS = ("--with-ft", "ulfm", "--mca", "btl", "tcp,self")
SHRINK_ENV = {"JDIST_JAX_DISTRIBUTED": "0"}


def launch(command: Sequence[str], args: argparse.Namespace) -> int:
  """Runs `command` under mpirun with ULFM; returns the exit status."""
  argv = supervise_lib.mpirun_argv(
      command, mpirun=args.mpirun, hostfile=args.hostfile, processes=args.processes,
      mpirun_args=list(ULFM_MPIRUN_ARGS) + shlex.split(args.mpirun_args))
  code, state = supervise_lib.supervise(argv, abort_grace=args.abort_grace,
                                        env=supervise_lib.environment(SHRINK_ENV))
  if state.shrink_finished and code != 0:
    sys.stderr.write(f"jdist launch --shrink: the surviving processes finished the run "
                     f"(mpirun's exit status {code} is the lost processes').\n")
    return 0
  return code
