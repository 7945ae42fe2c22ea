"""`jdist train` with injected faults, for tests/test_train_faults.py.

Run under mpirun (or plain python). Every rank runs `jdist train` with the
flags after `--`; the options before it inject a fault on rank `--rank`:

  --rank-args "FLAGS"   extra `jdist train` flags for that rank only (another
                        optimizer, learning rate, --train-limit, --cpu-devices)
  --nan-from STEP       that rank's training batches are NaN from global step
                        STEP on (the parameters become NaN: a diverging run)
  --nan-at STEP         only the batch of step STEP is NaN (a one-off spike)
  --drift               that rank applies its updates slightly differently (as
                        if it ran other code): its replicas drift apart

Lines on stderr mark when a fault starts ("jdist-job: rank R <what> at <unix
time>"). The exit status is `jdist train`'s.
"""

import argparse
import itertools
import shlex
import sys
import time

import numpy as np


def mark(me, what):
  print(f"jdist-job: rank {me} {what} at {time.time():.3f}", file=sys.stderr, flush=True)


def poison(me, first: int, last: int | None) -> None:
  """Makes the training loader's batches NaN for global steps first..last."""
  from jdist.data import loader as data  # pylint: disable=import-outside-toplevel
  original = data.ShardedLoader._generate  # pylint: disable=protected-access
  steps = itertools.count(1)

  def generate(self, epoch, start_batch):
    for batch in original(self, epoch, start_batch):
      if self.shuffle:  # the training loader (evaluation does not shuffle)
        step = next(steps)
        if step >= first and (last is None or step <= last):
          mark(me, f"feeding a NaN batch at step {step}")
          batch = dict(batch, x=np.full_like(batch["x"], np.nan))
      yield batch

  data.ShardedLoader._generate = generate  # pylint: disable=protected-access


def drift(me) -> None:
  """Scales this rank's new parameters by 1 + 1e-6 in every step it traces."""
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  apply_updates = optax.apply_updates
  mark(me, "drifting")
  optax.apply_updates = lambda params, updates: jax.tree.map(
      lambda x: x * (1 + 1e-6), apply_updates(params, updates))


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  split = argv.index("--") if "--" in argv else len(argv)
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rank", type=int, default=1)
  parser.add_argument("--rank-args", default="")
  parser.add_argument("--nan-from", type=int)
  parser.add_argument("--nan-at", type=int)
  parser.add_argument("--drift", action="store_true")
  args = parser.parse_args(argv[:split])
  train_argv = argv[split + 1:]
  from jdist.runtime import topology  # pylint: disable=import-outside-toplevel
  me = topology.launcher_rank()
  if me == args.rank:
    if args.rank_args:
      mark(me, f"adding {args.rank_args}")
      train_argv += shlex.split(args.rank_args)
    if args.nan_from is not None:
      poison(me, args.nan_from, None)
    if args.nan_at is not None:
      poison(me, args.nan_at, args.nan_at)
    if args.drift:
      drift(me)
  from jdist.app import cli  # pylint: disable=import-outside-toplevel
  return cli.train_main(train_argv)


if __name__ == "__main__":
  sys.exit(main())
