"""jdist.init() after JAX started its backends (`jax.devices()` first, as
tutorials are often structured), then three jit-style steps with a
cross-process exchange. Prints OK when the run works; a refused init must
say how to fix it and end the job at once."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

print("JAX DEVICES", len(jax.devices()), flush=True)  # starts JAX's backends

import jdist  # noqa: E402

topo = jdist.init()
jax.set_mesh(jdist.mesh())
tx = jdist.dist_opt(optax.sgd(0.1))
params = {"w": jnp.zeros((64, 1024)), "b": jnp.zeros(1024)}  # 64K floats: the deadlock's size
opt_state = tx.init(params)


@jax.jit
def step(params, opt_state, x):
  loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - 1) ** 2))(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss)


losses = []
for _ in range(3):
  x = jdist.shard_global_batch(np.ones((8 * topo.replica_count, 64), np.float32))
  params, opt_state, loss = step(params, opt_state, x)
  losses.append(float(loss))
assert losses[-1] < losses[0], losses
print(f"OK rank {topo.process_index} {topo}", flush=True)
