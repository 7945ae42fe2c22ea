"""`jdist launch --shrink`: mpirun with Open MPI's fault tolerance (ULFM) on.

The job runs under `mpirun --with-ft ulfm`, so that a process that dies
does not end the others (`jdist train --shrink` shrinks past it), with:

  * the TCP transport only (`--mca btl tcp,self`): with the shared-memory
    one, survivors on the same node never learn that a peer died (measured:
    an allreduce still waited 118 s after its peer's death, against 10 ms
    over TCP);
  * without the hierarchical collectives (`--mca coll ^han`): on a
    communicator spanning nodes that took in spawned processes (a job that
    grew back, `--max-np`), HAN's first broadcast crashed (SIGSEGV in
    `mca_coll_han_comm_create`, Open MPI 5.0.11 on the rig);
  * JAX's distributed runtime off (`JDIST_JAX_DISTRIBUTED=0`): its
    coordination service ends every process when one dies, and all of them
    when process 0 does.

mpirun's exit status is that of the failed processes even when the
survivors completed the run; the status here is 0 once the job's surviving
rank 0 said it finished.

With `--max-np N`, the survivors start new processes in the lost ones'
place (`MPI_Comm_spawn`) up to N; `--min-np M` stops a job left with fewer
than M processes that cannot grow. Both reach `jdist train --shrink`
through its environment (`MIN_NP_ENV`, `MAX_NP_ENV`).

A lost node is not shrunk past: PRRTE 3.0 (Open MPI 5.0's runtime) ends
the job when it loses a node's daemon, ULFM or not (`lost_node_message`).
With `--max-restarts N`, `jdist.app.launch_elastic` then starts the job
again without that node (each run under ULFM, through `mpirun_args`,
`environment` and `outcome` here), and it resumes from its checkpoints.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from typing import Sequence

from jdist.app import supervise as supervise_lib

ULFM_MPIRUN_ARGS = ("--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--mca", "coll", "^han")
SHRINK_ENV = {"JDIST_JAX_DISTRIBUTED": "0"}
MIN_NP_ENV, MAX_NP_ENV = "JDIST_SHRINK_MIN_NP", "JDIST_SHRINK_MAX_NP"


def ulfm_missing(mpirun: str) -> str | None:
  """Why the MPI of `mpirun` cannot run `--shrink`, or None where it can.

  ULFM is there when the `ompi_info` beside `mpirun` says `Fault Tolerance
  support: yes` (Open MPI >= 5.0 built with it, as PyPI's Open MPI that
  scripts/install.sh installs).
  """
  ompi_info = os.path.join(os.path.dirname(shutil.which(mpirun) or mpirun), "ompi_info")
  try:
    report = subprocess.run([ompi_info], capture_output=True, text=True, timeout=60).stdout
  except (OSError, subprocess.SubprocessError) as err:
    return (f"{ompi_info} could not run ({type(err).__name__}: {err}); --shrink needs Open "
            f"MPI >= 5.0 with fault tolerance (ULFM)")
  if "Fault Tolerance support: yes" not in report:
    return (f"{ompi_info} does not report 'Fault Tolerance support: yes': --shrink needs Open "
            f"MPI >= 5.0 built with ULFM (scripts/install.sh's Open MPI from PyPI has it); "
            f"without it use --max-restarts")
  return None


def check_sizes(args: argparse.Namespace) -> str | None:
  """What is wrong with `--min-np`/`--max-np` against `-np`, or None."""
  if args.min_np < 1:
    return f"--min-np {args.min_np} must be at least 1"
  if args.max_np < 0:
    return f"--max-np {args.max_np} must be >= 0 (0: never grow)"
  if args.max_np and args.processes and args.max_np < args.processes:
    return (f"--max-np {args.max_np} is below -np {args.processes}: the job grows back to "
            f"at most --max-np (give at least -np)")
  if args.max_np and args.min_np > args.max_np:
    return f"--min-np {args.min_np} is above --max-np {args.max_np}"
  return None


def mpirun_args(args: argparse.Namespace) -> list[str]:
  """mpirun's options for a `--shrink` run: ULFM's, then the user's `--mpirun-args`."""
  return list(ULFM_MPIRUN_ARGS) + shlex.split(args.mpirun_args)


def environment(args: argparse.Namespace) -> dict[str, str]:
  """What a `--shrink` run's processes see besides the launcher's environment."""
  return {**SHRINK_ENV, MIN_NP_ENV: str(args.min_np), MAX_NP_ENV: str(args.max_np)}


def outcome(code: int, state: supervise_lib.JobState, stderr=None) -> int:
  """The run's exit status: 0 once the survivors finished, whatever mpirun's."""
  if state.shrink_finished and code != 0:
    (stderr or sys.stderr).write(f"jdist launch --shrink: the surviving processes finished the "
                                 f"run (mpirun's exit status {code} is the lost processes').\n")
    return 0
  return code


def launch(command: Sequence[str], args: argparse.Namespace) -> int:
  """Runs `command` under mpirun with ULFM; returns the exit status (2: no ULFM)."""
  missing = ulfm_missing(args.mpirun)
  if missing:
    sys.stderr.write(f"jdist launch --shrink: {missing}.\n")
    return 2
  argv = supervise_lib.mpirun_argv(
      command, mpirun=args.mpirun, hostfile=args.hostfile, processes=args.processes,
      mpirun_args=mpirun_args(args))
  code, state = supervise_lib.supervise(argv, abort_grace=args.abort_grace,
                                        env=supervise_lib.environment(environment(args)))
  code = outcome(code, state)
  if code and state.lost():
    sys.stderr.write(lost_node_message(state.lost()))
  return code


def lost_node_message(hosts: Sequence[str]) -> str:
  """Why a lost node ended a `--shrink` job, and what to use instead.

  Open MPI 5.0's runtime (PRRTE 3.0) ends the whole job when it loses a
  node's daemon (a node killed, or its link down once PRRTE's keepalive
  expires), with ULFM on or not: `--shrink` survives lost processes, not
  lost nodes (measured on the rig: docs/multinode.md).
  """
  return (f"jdist launch --shrink: mpirun lost the daemon of {', '.join(hosts)} and ended the "
          f"job: Open MPI's runtime (PRRTE 3.0) does not run on past a lost node, ULFM or not, "
          f"so --shrink survives lost processes only. For lost nodes, add --max-restarts N "
          f"(and give jdist train --checkpoint-dir D --resume): the job then starts again "
          f"on the healthy hosts.\n")
