"""A/B of the jit style's new costs on README's quickstart steps (SINGA CNN, digits, global batch 64).

Not a test: a measurement, run by hand under mpirun, e.g. in 2 x 2:

  PYTHONPATH=. ROUNDS=30 bash scripts/mpirun.sh -np 2 -x ROUNDS \
      -x XLA_FLAGS=--xla_force_host_platform_device_count=2 .venv/bin/python tests/jobs/jit_ab.py

Rounds of two 20-step blocks in a shuffled order: outside any timeline
(`off`) and inside `jdist.timeline` (the file is written after the block's
timing); `tx.init` with the identical-start check on and off
(`JDIST_CHECK_START`); and the cost of `shard_global_batch`'s check for a
batch seen before. Rank 0 prints the medians as JSON (docs/timeline.md,
docs/reliability.md).
"""
import json, os, sys, time
import jax, numpy as np, optax
import jdist
from jdist import start_check, batches
from jdist.app import datasets, models

topo = jdist.init()
jax.set_mesh(jdist.mesh())
data = datasets.load_digits()
model = models.create_model("cnn", num_classes=10, input_shape=data.train_x.shape[1:])
params = jdist.broadcast_params(model.init(jax.random.key(0), data.train_x[:1]))
tx = jdist.dist_opt(optax.sgd(0.05, momentum=0.9))

def init_time(enabled):
  os.environ[start_check.ENABLE_ENV] = "1" if enabled else "0"
  start_check._checked = ()
  jdist.barrier()
  t = time.perf_counter(); state = tx.init(params); jax.block_until_ready(state)
  return time.perf_counter() - t, state

inits = {True: [], False: []}
for r in range(5):
  for on in (r % 2 == 0, r % 2 == 1):
    inits[on].append(init_time(on)[0])
os.environ[start_check.ENABLE_ENV] = "1"
opt_state = tx.init(params)

@jax.jit
def train_step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(lambda p: models.cross_entropy_loss(model.apply(p, batch["x"]), batch["y"]))(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss)

order = np.random.default_rng(0).permutation(len(data.train_x))
rows_list = order[:len(order) // 64 * 64].reshape(-1, 64)
BLOCK = int(os.environ.get("BLOCK", 20))
def block(state, k):
  p, s = state
  jdist.barrier()
  t = time.perf_counter()
  for i in range(BLOCK):
    rows = rows_list[(k * BLOCK + i) % len(rows_list)]
    b = jdist.shard_global_batch({"x": data.train_x[rows], "y": data.train_y[rows]})
    p, s, loss = train_step(p, s, b)
    if i % 8 == 7: jax.block_until_ready(loss)
  jax.block_until_ready(loss)
  return (p, s), (time.perf_counter() - t) / BLOCK

state = (params, opt_state)
state, _ = block(state, 0)  # compile
times = {"off": [], "timeline": []}
rounds = int(os.environ.get("ROUNDS", 12))
rng = np.random.default_rng(1)
k = 1
for r in range(rounds):
  for kind in rng.permutation(["off", "timeline"]):
    if kind == "timeline":
      tl = jdist.timeline(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"jit_ab_{r}.json"))
      state, dt = block(state, k)
      tl.close()
    else:
      state, dt = block(state, k)
    times[kind].append(dt); k += 1
ratios = [a / b for a, b in zip(times["timeline"], times["off"])]
sig_t = []
b = {"x": data.train_x[rows_list[0]], "y": data.train_y[rows_list[0]]}
t = time.perf_counter()
for _ in range(2000): batches.check_same_batch(b, "x")
sig_us = (time.perf_counter() - t) / 2000 * 1e6
if topo.process_index == 0:
  step = float(np.median(times["off"]))
  init_on, init_off = float(np.median(inits[True])), float(np.median(inits[False]))
  run_steps = 5 * len(rows_list)
  print(json.dumps({"topology": f"{topo.process_count}x{topo.local_device_count}",
      "step_ms_off": step * 1e3, "step_ms_timeline": float(np.median(times["timeline"])) * 1e3,
      "timeline_over_off_median": float(np.median(ratios)),
      "timeline_over_off_quartiles": [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))],
      "init_ms_check_on": init_on * 1e3, "init_ms_check_off": init_off * 1e3,
      "start_check_over_run_of_5_epochs": (run_steps * step + init_on) / (run_steps * step + init_off),
      "batch_check_us_per_call": sig_us, "batch_check_share_of_step": sig_us * 1e-6 / step}, indent=1))
