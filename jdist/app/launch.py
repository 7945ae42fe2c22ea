"""`jdist launch`: runs `mpirun` and makes sure a failed job ends, in bounded time.

    jdist launch --hostfile hosts -np 8 -- jdist train --epochs 5
    jdist launch --mpirun-args "--map-by ppr:2:node" -- python train.py

What plain `mpirun` does not guarantee, measured on a two-node rig
(`benchmarks.harness.cluster`, Open MPI 5.0 / PRRTE 3.0):

* A node whose link goes down is noticed by PRRTE only through TCP
  keepalive, 300 + 9 x 20 s by default; until then mpirun hangs. This
  supervisor passes `oob_tcp_keepalive_*` settings (1 s, then 3 probes 1 s
  apart: a link down ends the job about 4 s later) unless the environment
  already sets them.
* Once any rank has aborted (jdist's watchdog), mpirun's order to kill the
  job sits unacknowledged on the lost node's socket, keepalive no longer
  applies, and mpirun hangs for good. The supervisor sees the abort report
  (`jdist.runtime.abort.ABORT_MARKER` on the job's stderr) and ends mpirun
  `--abort-grace` seconds later.
* When PRRTE does notice a lost node it ends the job with exit status 0.
  The supervisor returns 1 and names the host and its ranks (rank 0 prints
  the rank -> host map at `jdist.init()` when launched this way).

The job's output passes through unchanged, apart from that one map line.

With `--max-restarts N` (and a `--hostfile`) a failed job is started again,
up to N times: hosts the failure names are left out for `--cooldown`
seconds, -np follows the healthy slots (or keeps the processes per node of
a fixed -np), and every rank sees `JDIST_RESTART=<k>`; below `--min-nodes`
healthy hosts it stops (`jdist.app.elastic`, docs/multinode.md "Elastic
restarts"). The command is run as given each time: for `jdist train`, give
it `--checkpoint-dir D --checkpoint-every K --resume` from the start.

`--host-discovery SCRIPT` replaces the hostfile with a script's output, read
at each (re)start and every `--discovery-interval` seconds. When the job runs
on fewer processes than the available hosts hold (a lost host past its
cooldown that answers a probe through the launch agent, or a host the
script newly lists), the supervisor waits for the job's next "checkpoint
saved at step S" line, stops it and starts it over the larger set: it
resumes from step S, with the same global batch (`elastic.restart_batch_size`).

With `--shrink`, mpirun runs with Open MPI's fault tolerance (ULFM) and a
process that dies does not end the job: the others shrink past it and keep
training from memory (`jdist train --shrink`, `jdist.app.launch_shrink`).
With `--shrink --max-restarts N`, a lost node (which ends the job: PRRTE
3.0) is restarted past as above, each run under ULFM again.
"""


from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

from jdist.app import elastic
from jdist.app import launch_elastic
from jdist.app import launch_shrink as shrink_mode
from jdist.app.supervise import (  # pylint: disable=unused-import  (tests and callers use them here)
    DEFAULT_ABORT_GRACE_S, EXIT_FAILURE, EXIT_USAGE, JobState, environment, mpirun_argv,
    supervise)

def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jdist launch", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--hostfile", help="mpirun hostfile (`HOST slots=N` lines)")
  parser.add_argument("--host-discovery", metavar="SCRIPT",
                      help="instead of --hostfile: an executable printing `HOST[:SLOTS]` or "
                      "`HOST slots=N` lines, run at each (re)start and periodically")
  parser.add_argument("--discovery-interval", type=float, metavar="SECONDS",
                      default=elastic.DEFAULT_DISCOVERY_INTERVAL_S,
                      help="how often to look for more hosts while the job runs (the discovery "
                      "script, or probes of hosts past their cooldown)")
  parser.add_argument("--probe-timeout", type=float, metavar="SECONDS",
                      default=elastic.DEFAULT_PROBE_TIMEOUT_S,
                      help="a hostfile host answers `AGENT HOST true` within this long, or "
                      "is not back")
  parser.add_argument("-np", "--np", type=int, dest="processes", help="number of processes")
  parser.add_argument("--mpirun", default="mpirun", help="the mpirun to run")
  parser.add_argument("--mpirun-args", default="", help="more mpirun options, one string")
  parser.add_argument("--abort-grace", type=float, default=DEFAULT_ABORT_GRACE_S,
                      help="seconds mpirun may take to end after a rank aborted the job")
  parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                      help="start a failed job again up to N times, without the hosts it lost")
  parser.add_argument("--min-nodes", type=int, default=1, metavar="M",
                      help="stop instead of restarting on fewer healthy hosts than this")
  parser.add_argument("--cooldown", type=float, default=elastic.DEFAULT_COOLDOWN_S,
                      metavar="SECONDS", help="a lost host is tried again after this long")
  parser.add_argument("--shrink", action="store_true",
                      help="run with Open MPI's fault tolerance (ULFM): processes that die are "
                      "shrunk past and the others keep training (`jdist train --shrink`)")
  parser.add_argument("--max-np", type=int, default=0, metavar="N",
                      help="with --shrink: after a shrink, start new processes (on the lost "
                      "ones' hosts) to grow back to N, handing them the state from memory "
                      "(0: never grow)")
  parser.add_argument("--min-np", type=int, default=1, metavar="M",
                      help="with --shrink: stop once fewer than M processes are left and none "
                      "can be started")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """`jdist launch ... -- CMD...`; returns the exit status."""
  args = build_parser().parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    sys.stderr.write("jdist launch: error: no command: give it after `--` "
                     "(jdist launch -np 2 -- jdist train).\n")
    return EXIT_USAGE
  if args.processes is not None and args.processes < 1:
    sys.stderr.write(f"jdist launch: error: -np {args.processes} must be at least 1.\n")
    return EXIT_USAGE
  if not args.abort_grace > 0:
    sys.stderr.write(f"jdist launch: error: --abort-grace {args.abort_grace} must be positive.\n")
    return EXIT_USAGE
  for name, value, least in (("--max-restarts", args.max_restarts, 0),
                             ("--min-nodes", args.min_nodes, 1)):
    if value < least:
      sys.stderr.write(f"jdist launch: error: {name} {value} must be at least {least}.\n")
      return EXIT_USAGE
  if not args.cooldown >= 0:
    sys.stderr.write(f"jdist launch: error: --cooldown {args.cooldown} must be >= 0.\n")
    return EXIT_USAGE
  for name, value in (("--discovery-interval", args.discovery_interval),
                      ("--probe-timeout", args.probe_timeout)):
    if not value > 0:
      sys.stderr.write(f"jdist launch: error: {name} {value} must be positive.\n")
      return EXIT_USAGE
  if args.hostfile and args.host_discovery:
    sys.stderr.write("jdist launch: error: give --hostfile or --host-discovery, not both.\n")
    return EXIT_USAGE
  if (args.max_np or args.min_np != 1) and not args.shrink:
    sys.stderr.write("jdist launch: error: --max-np and --min-np go with --shrink (with "
                     "--max-restarts, a restart starts the job on every healthy host).\n")
    return EXIT_USAGE
  if args.shrink:
    problem = shrink_mode.check_sizes(args)
    if problem:
      sys.stderr.write(f"jdist launch: error: {problem}.\n")
      return EXIT_USAGE
    if not (args.max_restarts or args.host_discovery):
      return shrink_mode.launch(command, args)
    missing = shrink_mode.ulfm_missing(args.mpirun)
    if missing:
      sys.stderr.write(f"jdist launch --shrink: {missing}.\n")
      return EXIT_USAGE
  if args.max_restarts or args.host_discovery:
    try:
      return launch_elastic.Elastic(command, args).run()
    except elastic.ElasticError as err:
      sys.stderr.write(f"jdist launch: error: {err}.\n")
      return EXIT_USAGE
  argv = mpirun_argv(command, mpirun=args.mpirun, hostfile=args.hostfile,
                     processes=args.processes, mpirun_args=shlex.split(args.mpirun_args))
  code, _ = supervise(argv, abort_grace=args.abort_grace, env=environment())
  return code
