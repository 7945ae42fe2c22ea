"""jdist: data-parallel training for JAX on every local device and across MPI processes.

The library a script imports lives here and in `jdist.runtime` (topology,
MPI world, watchdog, host exchanges), `jdist.collectives` (reductions inside
a step), `jdist.compression` and `jdist.transforms` (optax transformations);
`__all__` lists the library only. `jdist.app` is the `jdist train`
application built on it (command line, settings, training loop, model zoo,
datasets), imported as `jdist.app.<module>` and not re-exported here; its
old names `jdist.TrainConfig`, `jdist.datasets` and `jdist.models` still
resolve for one release, with a DeprecationWarning.

Names whose modules pull in heavy dependencies (orbax, flax) are imported on
first use, so `import jdist` and `jdist --help` stay light.
"""

import importlib
import warnings

from jdist import consistency
from jdist import data
from jdist import errors
from jdist import metrics
from jdist.consistency import ReplicaMismatch
from jdist.consistency import check_replicas
from jdist.collectives import DATA_AXIS
from jdist.collectives import all_gather
from jdist.collectives import mesh
from jdist.collectives import pmean
from jdist.collectives import psum
from jdist.collectives import replica_index
from jdist.collectives import replica_key
from jdist.data.loader import ShardedLoader
from jdist.data.grain import GrainLoader
from jdist.data.grain import grain_shard_options
from jdist.data.batches import process_slice
from jdist.data.batches import shard_global_batch
from jdist.data.batches import shard_batch as shard
from jdist.metrics import MetricAccumulator
from jdist.metrics import metric_sums
from jdist.parallel import data_parallel
from jdist.parallel import local_replicas
from jdist.parallel import replicate
from jdist.parallel import sync_params
from jdist.parallel import unreplicate
from jdist.runtime.host import barrier
from jdist.runtime.host import broadcast_params
from jdist.runtime.host import host_allreduce
from jdist.runtime.topology import Topology
from jdist.collectives.routes import init
from jdist.runtime.job import current as get_topology
from jdist.transforms.allreduce import AllReduceState
from jdist.transforms.allreduce import allreduce
from jdist.transforms.allreduce import wire_bytes
from jdist.compression.half import cast
from jdist.compression.powersgd import PowerSGDState
from jdist.compression.powersgd import powersgd
from jdist.compression.qsgd import QSGDState
from jdist.compression.qsgd import qsgd
from jdist.compression.sparse import SparsifyState
from jdist.compression.sparse import threshold
from jdist.compression.sparse import topk
from jdist.transforms.diloco import DiLoCoState
from jdist.transforms.diloco import diloco
from jdist.transforms.dist_opt import dist_opt
from jdist.transforms.finite import SkipNonFiniteState
from jdist.transforms.finite import skip_nonfinite
from jdist.transforms.local_sgd import LocalSGDState
from jdist.transforms.local_sgd import local_sgd
from jdist.transforms.partial import PartialSyncState
from jdist.transforms.partial import partial_sync
from jdist.tracing.recorder import timeline

__version__ = "0.1.0"

# name -> (module, attribute or None for the module itself), imported on first use.
_LAZY = {
    "CheckpointManager": ("jdist.checkpoint", "CheckpointManager"),
    "SyncBatchNorm": ("jdist.flax_nnx", "SyncBatchNorm"),
    "nnx_data_parallel": ("jdist.flax_nnx", "nnx_data_parallel"),
    "replica_mean": ("jdist.flax_nnx", "replica_mean"),
    "checkpoint": ("jdist.checkpoint", None),
}
# Names of the training application that `jdist` re-exported until 0.1: they
# resolve, with a DeprecationWarning, for one more release.
_MOVED = {
    "TrainConfig": ("jdist.app.config", "TrainConfig"),
    "datasets": ("jdist.app.datasets", None),
    "models": ("jdist.app.models", None),
}


def __getattr__(name):
  if name in _MOVED:
    module_name, attribute = _MOVED[name]
    new = module_name if attribute is None else f"{module_name}.{attribute}"
    warnings.warn(f"jdist.{name} is part of the training application, not the library: "
                  f"use {new} (jdist.{name} goes away in the next release).",
                  DeprecationWarning, stacklevel=2)
    module = importlib.import_module(module_name)
    return module if attribute is None else getattr(module, attribute)
  if name not in _LAZY:
    raise AttributeError(f"module 'jdist' has no attribute {name!r}")
  module_name, attribute = _LAZY[name]
  module = importlib.import_module(module_name)
  value = module if attribute is None else getattr(module, attribute)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_LAZY))

__all__ = (
    "AllReduceState",
    "CheckpointManager",
    "MetricAccumulator",
    "ShardedLoader",
    "SkipNonFiniteState",
    "DATA_AXIS",
    "DiLoCoState",
    "GrainLoader",
    "LocalSGDState",
    "PartialSyncState",
    "PowerSGDState",
    "QSGDState",
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
    "diloco",
    "dist_opt",
    "errors",
    "get_topology",
    "grain_shard_options",
    "host_allreduce",
    "init",
    "local_replicas",
    "local_sgd",
    "mesh",
    "nnx_data_parallel",
    "metric_sums",
    "metrics",
    "partial_sync",
    "pmean",
    "powersgd",
    "process_slice",
    "psum",
    "qsgd",
    "replica_index",
    "replica_key",
    "replica_mean",
    "replicate",
    "shard",
    "shard_global_batch",
    "skip_nonfinite",
    "sync_params",
    "threshold",
    "timeline",
    "topk",
    "unreplicate",
    "wire_bytes",
)
