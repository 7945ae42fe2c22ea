"""jdist: data-parallel training for JAX on every local device and across MPI processes."""

from jdist import checkpoint
from jdist import consistency
from jdist import data
from jdist import datasets
from jdist import errors
from jdist import metrics
from jdist import models
from jdist.checkpoint import CheckpointManager
from jdist.consistency import ReplicaMismatch
from jdist.consistency import check_replicas
from jdist.config import TrainConfig
from jdist.collectives import DATA_AXIS
from jdist.collectives import all_gather
from jdist.collectives import barrier
from jdist.collectives import broadcast_params
from jdist.collectives import host_allreduce
from jdist.collectives import mesh
from jdist.collectives import pmean
from jdist.collectives import psum
from jdist.collectives import replica_index
from jdist.collectives import replica_key
from jdist.data import ShardedLoader
from jdist.flax_nnx import SyncBatchNorm
from jdist.batches import process_slice
from jdist.batches import shard_global_batch
from jdist.batches import shard_batch as shard
from jdist.metrics import MetricAccumulator
from jdist.metrics import metric_sums
from jdist.parallel import data_parallel
from jdist.parallel import local_replicas
from jdist.parallel import replicate
from jdist.parallel import unreplicate
from jdist.topology import Topology
from jdist.topology import init
from jdist.topology import current as get_topology
from jdist.transforms.allreduce import AllReduceState
from jdist.transforms.allreduce import allreduce
from jdist.transforms.allreduce import wire_bytes
from jdist.transforms.compress import SparsifyState
from jdist.transforms.compress import cast
from jdist.transforms.compress import threshold
from jdist.transforms.compress import topk
from jdist.transforms.dist_opt import dist_opt
from jdist.transforms.finite import SkipNonFiniteState
from jdist.transforms.finite import skip_nonfinite
from jdist.transforms.partial import PartialSyncState
from jdist.transforms.partial import partial_sync
from jdist.transforms.partial import sync_params

__version__ = "0.1.0"

__all__ = (
    "AllReduceState",
    "CheckpointManager",
    "MetricAccumulator",
    "ShardedLoader",
    "SkipNonFiniteState",
    "TrainConfig",
    "DATA_AXIS",
    "PartialSyncState",
    "ReplicaMismatch",
    "SparsifyState",
    "SyncBatchNorm",
    "Topology",
    "all_gather",
    "allreduce",
    "barrier",
    "broadcast_params",
    "cast",
    "check_replicas",
    "checkpoint",
    "consistency",
    "data",
    "data_parallel",
    "datasets",
    "dist_opt",
    "errors",
    "get_topology",
    "host_allreduce",
    "init",
    "local_replicas",
    "mesh",
    "metric_sums",
    "metrics",
    "models",
    "partial_sync",
    "pmean",
    "process_slice",
    "psum",
    "replica_index",
    "replica_key",
    "replicate",
    "shard",
    "shard_global_batch",
    "skip_nonfinite",
    "sync_params",
    "threshold",
    "topk",
    "unreplicate",
    "wire_bytes",
)
