"""Which examples each replica reads in each epoch, agreed without communication.

Each replica (one local device of one process, see `jdist.runtime.topology`)
reads its own slice of each epoch, as PyTorch's `DistributedSampler` does: all
ranks draw the same permutation from `(seed, epoch)` and replica `r` of `R`
takes `permutation[r::R]`. `jdist.data.ShardedLoader` batches these slices;
the public names are importable from `jdist.data`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def check_int(name: str, value: Any, minimum: int) -> None:
  """Raises ValueError unless `value` is an integer >= `minimum`."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an integer >= {minimum}.")


def epoch_permutation(num_examples: int, *, epoch: int, seed: int) -> np.ndarray:
  """The order of all examples in one epoch, identical on every rank.

  Args:
    num_examples: size of the dataset.
    epoch: epoch number (>= 0); each epoch gets a different order.
    seed: run seed (>= 0), the same on every process.

  Returns:
    An int64 permutation of `range(num_examples)`.

  Raises:
    ValueError: a negative or non-integer argument.
  """
  check_int("num_examples", num_examples, 0)
  check_int("epoch", epoch, 0)
  check_int("seed", seed, 0)
  # Seeding with the pair (not seed + epoch) keeps (seed=0, epoch=1) and
  # (seed=1, epoch=0) apart.
  rng = np.random.default_rng((int(seed), int(epoch)))
  return rng.permutation(num_examples).astype(np.int64)


def epoch_order(num_examples: int, *, replica_count: int, epoch: int, seed: int,
                 shuffle: bool, drop_last: bool) -> tuple[np.ndarray, np.ndarray]:
  """The whole epoch, trimmed or padded to a multiple of `replica_count`.

  Returns:
    `(order, is_real)`: the example index at every position, and False where
    the position only pads the epoch (a repeat from the start of the order).
  """
  if shuffle:
    order = epoch_permutation(num_examples, epoch=epoch, seed=seed)
  else:
    order = np.arange(num_examples, dtype=np.int64)
  if drop_last:
    total = (num_examples // replica_count) * replica_count
    return order[:total], np.ones(total, dtype=bool)
  total = math.ceil(num_examples / replica_count) * replica_count
  # np.resize repeats cyclically, so padding longer than the dataset (fewer
  # examples than replicas) still works.
  return np.resize(order, total), np.arange(total) < num_examples


def check_partition_args(num_examples: int, replica_index: int, replica_count: int,
                          drop_last: bool) -> None:
  """Raises ValueError for arguments that leave a replica without a valid slice."""
  check_int("num_examples", num_examples, 1)
  check_int("replica_count", replica_count, 1)
  check_int("replica_index", replica_index, 0)
  if replica_index >= replica_count:
    raise ValueError(
        f"replica_index={replica_index} is out of range for replica_count="
        f"{replica_count}; use 0 <= replica_index < replica_count.")
  if drop_last and num_examples < replica_count:
    raise ValueError(
        f"drop_last=True with {num_examples} examples and {replica_count} "
        f"replicas leaves no example for any replica; use drop_last=False or "
        f"at least {replica_count} examples.")


def replica_indices(num_examples: int, *, replica_index: int, replica_count: int,
                    epoch: int = 0, seed: int = 0, shuffle: bool = True,
                    drop_last: bool = False) -> np.ndarray:
  """Example indices that one replica reads in one epoch.

  Same semantics as PyTorch's `DistributedSampler`: replica `r` takes the
  strided slice `order[r::replica_count]` of an order shared by all ranks.

  Args:
    num_examples: size of the dataset (the same on every process).
    replica_index: global index of the replica, in `[0, replica_count)`.
    replica_count: number of replicas in the job.
    epoch: epoch number, so each epoch is shuffled differently.
    seed: run seed, the same on every process.
    shuffle: if False, the order is `0, 1, ..., num_examples - 1`.
    drop_last: if True, the last `num_examples % replica_count` examples of
      the order are dropped so no example is read twice. If False, the order
      is padded by repeating its first examples, so some examples are read
      twice but every replica gets `ceil(num_examples / replica_count)`.

  Returns:
    An int64 array, the same length on every replica.

  Raises:
    ValueError: an argument out of range.
  """
  check_partition_args(num_examples, replica_index, replica_count, drop_last)
  order, _ = epoch_order(num_examples, replica_count=replica_count, epoch=epoch,
                          seed=seed, shuffle=shuffle, drop_last=drop_last)
  return order[replica_index::replica_count]


def batches_per_epoch(num_examples: int, *, batch_size: int, replica_count: int,
                      drop_last: bool = True) -> int:
  """Steps in one epoch when each replica takes `batch_size` examples a step.

  Args:
    num_examples: size of the dataset.
    batch_size: examples per replica per step.
    replica_count: number of replicas in the job.
    drop_last: if True, only full steps count (each epoch skips
      `num_examples % (batch_size * replica_count)` examples); if False, the
      last, partial step counts too.

  Returns:
    The number of steps (0 when drop_last and the dataset is smaller than one
    global batch).
  """
  check_int("num_examples", num_examples, 0)
  check_int("batch_size", batch_size, 1)
  check_int("replica_count", replica_count, 1)
  if drop_last:
    return num_examples // (batch_size * replica_count)
  return math.ceil(math.ceil(num_examples / replica_count) / batch_size)
