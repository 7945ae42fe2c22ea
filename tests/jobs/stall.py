"""A small data-parallel training job with injected faults, for watchdog tests.

Run under mpirun (tests/test_watchdog.py; benchmarks/stall_repeat.py until commit d7ea04b). Every
rank trains a tiny MLP with `jdist.dist_opt(optax.sgd)`, started with
`jdist.init(timeout=--timeout)`. Each `--fault KIND:STEP` (repeatable) makes
rank `--rank` misbehave just before dispatching step STEP (1-based):

  stall:S       sleeps `--sleep` seconds (past the deadline: must abort)
  late:S        sleeps `--late` seconds (within the deadline: must pass)
  kill:S        SIGKILLs itself (the launcher must end the job)
  raise:S       raises an exception (the job must end at once)
  exit:S        calls sys.exit(3): leaves the loop early without an exception
                (the others' watchdog must end the job soon after)
  preinit:0     starts MPI (imports mpi4py), then sleeps `--sleep` seconds
                before calling jdist.init (the others must give up at
                JDIST_INIT_TIMEOUT, naming it)
  prempi:0      sleeps `--sleep` seconds before starting MPI at all (the
                others must say why they wait, at JDIST_INIT_TIMEOUT)
                (the others' watchdog must end the job soon after)
  barrier:S     every rank calls jdist.barrier(); the faulty rank sleeps
                `--sleep` seconds first (a host-side stall: must abort)
  checkpoint:S  rank 0 "writes a checkpoint" for `--checkpoint` seconds while the
                others wait in a barrier (within the deadline: must pass)
  compile:S     the faulty rank traces and compiles a function for
                `--compile` seconds first, longer than the deadline
                (compiling must not count)
  retrace:S     the faulty rank's batch of step S has one example fewer per
                replica: only it re-traces the step (must abort in seconds,
                naming the new shape)
  dtype:S       the faulty rank's batch of step S is float16: the same, for a dtype
  extra:S       the faulty rank runs step S twice (one step more than the
                others); after the loop every rank calls jdist.barrier() (must
                abort in seconds)
  hostexit:S    every rank calls jdist.barrier() 20 times; then the faulty rank
                calls sys.exit(3) while the others call jdist.barrier() (must
                abort DEPARTURE_GRACE_S after the exit)

Lines on stderr mark when a fault starts ("jdist-job: rank R <kind> at
<unix time>"); rank 0 prints "jdist-job: done" when training ends.
"""

import argparse
import faulthandler
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import optax

import jdist
from tests import reference

KINDS = ("stall", "late", "kill", "raise", "exit", "barrier", "checkpoint", "compile",
         "preinit", "prempi", "retrace", "dtype", "extra", "hostexit")


def parse_fault(text):
  kind, _, step = text.partition(":")
  if kind not in KINDS or not step.isdigit():
    raise argparse.ArgumentTypeError(f"--fault {text!r}: use KIND:STEP, KIND in {KINDS}")
  return kind, int(step)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--fault", type=parse_fault, action="append", default=[])
  parser.add_argument("--rank", type=int, default=1, help="the rank that misbehaves")
  parser.add_argument("--sleep", type=float, default=60.0, help="seconds a stall lasts")
  parser.add_argument("--late", type=float, default=3.0, help="seconds a tolerated delay lasts")
  parser.add_argument("--checkpoint", type=float, default=7.0,
                      help="seconds rank 0 spends writing a checkpoint")
  parser.add_argument("--compile", type=float, default=6.0,
                      help="seconds the faulty rank spends compiling (tracing)")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--timeout", type=float, default=10.0, help="jdist.init(timeout=...)")
  parser.add_argument("--per-replica", type=int, default=4, help="examples per replica")
  parser.add_argument("--sync", action="store_true", help="wait for every step's loss")
  return parser.parse_args(argv)


def mark(me, what):
  print(f"jdist-job: rank {me} {what} at {time.time():.3f}", file=sys.stderr, flush=True)


def compile_slowly(me, seconds):
  """Traces and compiles a function whose tracing takes `seconds`.

  A slow tracer stands in for a slow compile (a big model, a loaded
  machine): either way the main thread is inside JAX's tracer/compiler, and
  the sleep makes the duration the same on every machine.
  """
  def slow_to_trace(x):
    time.sleep(seconds)  # runs once, while JAX traces
    return jnp.sin(x) + 1
  start = time.monotonic()
  jax.jit(slow_to_trace).lower(jnp.ones(8)).compile()
  mark(me, f"compiled for {time.monotonic() - start:.1f} s")


def inject(kind, step, me, faulty, args, replicated):
  if kind in ("stall", "late") and faulty:
    seconds = args.sleep if kind == "stall" else args.late
    mark(me, f"sleeping {seconds:g} s before step {step}")
    time.sleep(seconds)
  elif kind == "kill" and faulty:
    mark(me, f"killing itself before step {step}")
    os.kill(os.getpid(), signal.SIGKILL)
  elif kind == "raise" and faulty:
    mark(me, f"raising before step {step}")
    raise RuntimeError(f"injected failure on rank {me} before step {step}")
  elif kind == "exit" and faulty:
    mark(me, f"exiting before step {step}")
    sys.exit(3)
  elif kind == "barrier":
    if faulty:
      mark(me, f"sleeping {args.sleep:g} s before a barrier")
      time.sleep(args.sleep)
    jdist.barrier()
  elif kind == "checkpoint":
    jax.block_until_ready(replicated)
    if me == 0:
      mark(me, f"writing a checkpoint for {args.checkpoint:g} s")
      time.sleep(args.checkpoint)
    jdist.barrier("checkpoint")
  elif kind == "compile" and faulty:
    mark(me, f"compiling before step {step}")
    compile_slowly(me, args.compile)
  elif kind == "hostexit":
    for _ in range(20):
      jdist.barrier("one of 20 barriers")
    if faulty:
      mark(me, f"exiting after 20 barriers before step {step}")
      sys.exit(3)
    jdist.barrier("after the exit")


def alter_batch(kinds, me, faulty, x, y):
  """The faulty rank's batch for step S of a retrace:S or dtype:S fault."""
  if faulty and "retrace" in kinds:
    mark(me, "re-tracing with a shorter batch")
    return x[:, :-1], y[:, :-1]
  if faulty and "dtype" in kinds:
    mark(me, "re-tracing with a float16 batch")
    return x.astype(jnp.float16), y
  return x, y


def main(argv=None):
  args = parse_args(argv)
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand, for debugging
  early = {kind for kind, _ in args.fault} & {"preinit", "prempi"}
  if early and jdist.runtime.topology.launcher_rank() == args.rank:
    if "preinit" in early:
      from mpi4py import MPI  # pylint: disable=unused-import,import-outside-toplevel
    mark(args.rank, f"sleeping {args.sleep:g} s before jdist.init")
    time.sleep(args.sleep)
  topo = jdist.init(timeout=args.timeout)
  me = topo.process_index
  faulty = me == args.rank

  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = jdist.broadcast_params(model.init(jax.random.key(me), x0))
  tx = jdist.dist_opt(optax.sgd(0.05))
  replicated = jdist.replicate(params)
  opt_state = jdist.data_parallel(tx.init)(replicated)

  @jdist.data_parallel
  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(lambda p: reference.loss_fn(model, p, x, y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss)

  per_replica = args.per_replica
  batches = [reference.global_batch(topo.replica_count, per_replica, seed=s) for s in range(3)]
  local = [(reference.local_slices(x, topo, per_replica),
            reference.local_slices(y, topo, per_replica)) for x, y in batches]

  loss = None
  for step in range(1, args.steps + 1):
    for kind, at in args.fault:
      if at == step:
        inject(kind, step, me, faulty, args, replicated)
    x, y = local[step % len(local)]
    now = {kind for kind, at in args.fault if at == step}
    x, y = alter_batch(now, me, faulty, x, y)
    for _ in range(2 if faulty and "extra" in now else 1):
      if faulty and "extra" in now:
        mark(me, f"running step {step} twice")
      replicated, opt_state, loss = train_step(replicated, opt_state, x, y)
    if args.sync:
      loss.block_until_ready()
  if any(kind == "extra" for kind, _ in args.fault):
    jdist.barrier("after training")
  final = float(jdist.unreplicate(loss))
  if me == 0:
    print(f"jdist-job: done, {args.steps} steps, loss {final:.4f}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
