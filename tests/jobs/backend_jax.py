"""A 2-process job on JAX's own multi-process backend (gloo on CPU): 20 SGD
steps must match one device on the whole batch. Prints OK on success."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import optax  # noqa: E402

import jdist  # noqa: E402
from tests import reference  # noqa: E402

topo = jdist.init(backend="jax")
assert jax.process_count() == topo.process_count
model = reference.TinyMLP()
x0, _ = reference.global_batch(1, 1)
params = jdist.broadcast_params(model.init(jax.random.key(topo.process_index), x0))
batches = [reference.global_batch(topo.replica_count, 4, seed=s) for s in range(3)]
inner = optax.sgd(0.05, momentum=0.9)
expected = reference.train_reference(model, params, inner, batches, 20)
replicated, _ = reference.train_jdist(model, params, jdist.dist_opt(inner), batches, 20, topo, 4)
for replica in jdist.local_replicas(replicated):
  reference.assert_trees_close(replica, expected, rtol=1e-5, atol=1e-6)
print(f"OK rank {topo.process_index} {topo}")
