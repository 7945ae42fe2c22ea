"""Each replica's share of the data: epoch order, batches, loaders.

  * `epoch_order`: the permutation every rank draws from (seed, epoch) and
    each replica's slice of it (no communication to agree on the split);
  * `batches`: placing a batch on the local devices (`jdist.shard`) or each
    process's rows of a global batch (`jdist.shard_global_batch`);
  * `loader`: `ShardedLoader`, batches already placed, prefetched;
  * `grain`: grain's shard options and `GrainLoader`.

`jdist.data.ShardedLoader`, `jdist.data.epoch_permutation`,
`jdist.data.replica_indices` and `jdist.data.batches_per_epoch` are public.
"""

from jdist.data.epoch_order import batches_per_epoch
from jdist.data.epoch_order import epoch_permutation
from jdist.data.epoch_order import replica_indices
from jdist.data.loader import ShardedLoader

__all__ = ("ShardedLoader", "batches_per_epoch", "epoch_permutation", "replica_indices")
