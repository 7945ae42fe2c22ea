"""jdist in 20 lines, per-replica style (jdist.data_parallel): `python examples/quickstart_data_parallel.py`."""
import jax, optax
import jdist
from jdist.app import datasets, models

topo = jdist.init()                          # MPI under mpirun, else one process
data = datasets.load_digits()                # bundled with scikit-learn: no download
model = models.create_model("cnn", num_classes=10, input_shape=data.train_x.shape[1:])
params = model.init(jax.random.key(topo.process_index), data.train_x[:1])  # differs per rank...
params = jdist.replicate(jdist.broadcast_params(params))                  # ...so start from rank 0's
tx = jdist.dist_opt(optax.sgd(0.05, momentum=0.9))    # or half=True, sparsify="topk:0.01", partial=4
opt_state = jdist.data_parallel(tx.init)(params)

@jdist.data_parallel                         # pmap over local devices; reductions span every replica
def train_step(params, opt_state, x, y):
  loss, grads = jax.value_and_grad(lambda p: models.cross_entropy_loss(model.apply(p, x), y))(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, jdist.pmean(loss)

loader = jdist.ShardedLoader({"x": data.train_x, "y": data.train_y}, batch_size=16, topology=topo)
for epoch in range(5):
  for batch in loader.epoch(epoch):
    params, opt_state, loss = train_step(params, opt_state, batch["x"], batch["y"])
  if topo.is_primary:
    print(f"epoch {epoch}: loss {float(loss[0]):.3f} on {topo.replica_count} replicas")
