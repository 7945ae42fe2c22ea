"""A/B of the jit style's new costs on README's quickstart steps (SINGA CNN, digits, global batch 64).

Not a test: a measurement, run by hand under mpirun, e.g. in 2 x 2:

  ROUNDS=30 bash scripts/mpirun.sh -np 2 -x ROUNDS \
      -x XLA_FLAGS=--xla_force_host_platform_device_count=2 .venv/bin/python tests/jobs/jit_ab.py

Rounds of two 20-step blocks in a shuffled order: outside any timeline
(`off`) and inside `jdist.timeline` (the file is written after the block's
timing); `tx.init` with the identical-start check on and off
(`JDIST_CHECK_START`); and the cost of `shard_global_batch`'s check for a
batch seen before. Rank 0 prints the medians as JSON (docs/timeline.md,
docs/reliability.md).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jdist  # noqa: E402
from jdist.data import batches  # noqa: E402
from jdist.runtime import start_check  # noqa: E402
from jdist.app import datasets, models  # noqa: E402

BLOCK = int(os.environ.get("BLOCK", 20))  # steps per timed block
ROUNDS = int(os.environ.get("ROUNDS", 12))


def _init_seconds(tx, params, enabled: bool) -> float:
  """Seconds of one `tx.init(params)`, the identical-start check on or off."""
  os.environ[start_check.ENABLE_ENV] = "1" if enabled else "0"
  jdist.barrier()
  started = time.perf_counter()
  jax.block_until_ready(tx.init(params))
  return time.perf_counter() - started


def _step_fn(model, tx):
  """README's quickstart step."""
  @jax.jit
  def train_step(params, opt_state, batch):
    def loss_fn(p):
      return models.cross_entropy_loss(model.apply(p, batch["x"]), batch["y"])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss)
  return train_step


def _block(train_step, state, data, rows, first: int):
  """Runs BLOCK steps from batch `first` on; returns the state and seconds per step."""
  params, opt_state = state
  jdist.barrier()
  started = time.perf_counter()
  for i in range(BLOCK):
    picked = rows[(first + i) % len(rows)]
    batch = jdist.shard_global_batch({"x": data.train_x[picked], "y": data.train_y[picked]})
    params, opt_state, loss = train_step(params, opt_state, batch)
    if i % 8 == 7:  # XLA:CPU deadlocks when the host runs too far ahead
      jax.block_until_ready(loss)
  jax.block_until_ready(loss)
  return (params, opt_state), (time.perf_counter() - started) / BLOCK


def _batch_check_us(data, rows) -> float:
  """Microseconds per `check_same_batch` of a batch seen before."""
  batch = {"x": data.train_x[rows[0]], "y": data.train_y[rows[0]]}
  batches.check_same_batch(batch, "jit_ab")
  started = time.perf_counter()
  for _ in range(2000):
    batches.check_same_batch(batch, "jit_ab")
  return (time.perf_counter() - started) / 2000 * 1e6


def main():
  topo = jdist.init()
  jax.set_mesh(jdist.mesh())
  data = datasets.load_digits()
  model = models.create_model("cnn", num_classes=10, input_shape=data.train_x.shape[1:])
  params = jdist.broadcast_params(model.init(jax.random.key(0), data.train_x[:1]))
  tx = jdist.dist_opt(optax.sgd(0.05, momentum=0.9))
  inits = {True: [], False: []}
  for r in range(5):
    for on in (r % 2 == 0, r % 2 == 1):
      inits[on].append(_init_seconds(tx, params, on))
  os.environ[start_check.ENABLE_ENV] = "1"
  train_step = _step_fn(model, tx)
  order = np.random.default_rng(0).permutation(len(data.train_x))
  rows = order[:len(order) // 64 * 64].reshape(-1, 64)
  state, _ = _block(train_step, (params, tx.init(params)), data, rows, 0)  # compiles
  times = {"off": [], "timeline": []}
  rng = np.random.default_rng(1)
  for r in range(ROUNDS):
    for kind in rng.permutation(["off", "timeline"]):
      first = (2 * r + 1) * BLOCK
      if kind == "timeline":
        recorder = jdist.timeline(os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                               f"jit_ab_{r}.json"))
        state, seconds = _block(train_step, state, data, rows, first)
        recorder.close()  # after the timing: the file is written at the end
      else:
        state, seconds = _block(train_step, state, data, rows, first)
      times[kind].append(seconds)
  check_us = _batch_check_us(data, rows)
  if topo.process_index != 0:
    return
  ratios = [a / b for a, b in zip(times["timeline"], times["off"])]
  step = float(np.median(times["off"]))
  init_on, init_off = float(np.median(inits[True])), float(np.median(inits[False]))
  run = 5 * len(rows) * step  # quickstart's 5 epochs
  print(json.dumps({
      "topology": f"{topo.process_count}x{topo.local_device_count}", "rounds": ROUNDS,
      "step_ms_off": step * 1e3, "step_ms_timeline": float(np.median(times["timeline"])) * 1e3,
      "timeline_over_off_median": float(np.median(ratios)),
      "timeline_over_off_quartiles": [float(np.percentile(ratios, q)) for q in (25, 75)],
      "init_ms_check_on": init_on * 1e3, "init_ms_check_off": init_off * 1e3,
      "start_check_over_5_epochs": (run + init_on) / (run + init_off),
      "batch_check_us_per_call": check_us, "batch_check_share_of_step": check_us * 1e-6 / step,
  }, indent=1))


if __name__ == "__main__":
  main()
