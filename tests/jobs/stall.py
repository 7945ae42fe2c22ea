"""A small data-parallel training job with an injected fault, for watchdog tests.

Run under mpirun (see tests/test_watchdog.py). Every rank trains a tiny MLP
with `jdist.dist_opt(optax.sgd)`; at step `--at` the rank `--rank` misbehaves:

  --fault stall    sleeps `--sleep` seconds before dispatching the step
                   (longer than the deadline: the watchdog must abort the job)
  --fault late     the same, with a sleep shorter than the deadline (must pass)
  --fault kill     SIGKILLs itself (the launcher must end the job)
  --fault barrier  every rank calls jdist.barrier(); the faulty rank sleeps first
  --fault checkpoint  rank 0 "writes a checkpoint" (sleeps) while the others
                   wait in a barrier, within the deadline (must pass)
  --fault none     no fault

Prints "jdist-job: done" on rank 0 and exits 0 when training finishes.
"""

import argparse
import os
import signal
import sys
import time

import jax
import numpy as np
import optax

import jdist
from tests import reference


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--fault", default="none",
                      choices=("none", "stall", "late", "kill", "barrier", "checkpoint"))
  parser.add_argument("--rank", type=int, default=1, help="the rank that misbehaves")
  parser.add_argument("--at", type=int, default=5, help="the step (1-based) it misbehaves at")
  parser.add_argument("--sleep", type=float, default=60.0, help="seconds a stall lasts")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--timeout", type=float, default=10.0, help="jdist.init(timeout=...)")
  parser.add_argument("--sync", action="store_true",
                      help="wait for every step's loss (default: steps run back to back)")
  parser.add_argument("--slow-compile", type=float, default=0.0,
                      help="extra seconds rank --rank spends before its first step, "
                           "as if compiling slowly")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
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

  per_replica = 4
  batches = [reference.global_batch(topo.replica_count, per_replica, seed=s) for s in range(3)]
  local = [(reference.local_slices(x, topo, per_replica), reference.local_slices(y, topo, per_replica))
           for x, y in batches]
  if faulty and args.slow_compile:
    time.sleep(args.slow_compile)

  loss = None
  for step in range(1, args.steps + 1):
    if step == args.at:
      if args.fault in ("stall", "late") and faulty:
        print(f"jdist-job: rank {me} sleeping {args.sleep:g} s before step {step}",
              file=sys.stderr, flush=True)
        time.sleep(args.sleep)
      elif args.fault == "kill" and faulty:
        print(f"jdist-job: rank {me} killing itself at step {step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      elif args.fault == "barrier":
        if faulty:
          time.sleep(args.sleep)
        jdist.barrier()
      elif args.fault == "checkpoint":
        jax.block_until_ready(replicated)
        if me == 0:
          time.sleep(args.sleep)  # writing a checkpoint, within the deadline
        jdist.barrier("checkpoint")
    x, y = local[step % len(local)]
    replicated, opt_state, loss = train_step(replicated, opt_state, x, y)
    if args.sync:
      loss.block_until_ready()
  final = float(jdist.unreplicate(loss))
  if me == 0:
    print(f"jdist-job: done, {args.steps} steps, loss {final:.4f}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
