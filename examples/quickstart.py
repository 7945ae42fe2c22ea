"""jdist in 20 lines: `python examples/quickstart.py` or `mpirun -np 2 python examples/quickstart.py`."""
import jax, numpy as np, optax
import jdist
from jdist.app import datasets, models

topo = jdist.init()                          # MPI under mpirun, else one process
jax.set_mesh(jdist.mesh())                   # jit steps span every local device
data = datasets.load_digits()                # bundled with scikit-learn: no download
model = models.create_model("cnn", num_classes=10, input_shape=data.train_x.shape[1:])
params = model.init(jax.random.key(topo.process_index), data.train_x[:1])  # differs per rank...
params = jdist.broadcast_params(params)                                   # ...so start from rank 0's
tx = jdist.dist_opt(optax.sgd(0.05, momentum=0.9))    # or half=True, sparsify="topk:0.01", partial=4
opt_state = tx.init(params)

@jax.jit                                     # global arrays; jdist's reductions span every process
def train_step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(lambda p: models.cross_entropy_loss(model.apply(p, batch["x"]), batch["y"]))(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss)

for epoch in range(5):                       # global batches of 64, the same order on every process
  order = np.random.default_rng(epoch).permutation(len(data.train_x))
  for rows in order[:len(order) // 64 * 64].reshape(-1, 64):
    batch = jdist.shard_global_batch({"x": data.train_x[rows], "y": data.train_y[rows]})  # my rows
    params, opt_state, loss = train_step(params, opt_state, batch)
  if topo.is_primary:
    print(f"epoch {epoch}: loss {float(loss):.3f} on {topo.replica_count} replicas")
