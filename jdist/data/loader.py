"""Per-replica data partitioning and a prefetching loader for `jax.pmap`.

Each replica (one local device of one process, see `jdist.runtime.topology`) reads its
own slice of each epoch, as PyTorch's `DistributedSampler` does: all ranks
draw the same permutation from `(seed, epoch)` and replica `r` of `R` takes
`permutation[r::R]`, so no communication is needed to agree on the split
(`jdist.data.epoch_order`).

`ShardedLoader` turns those index lists into batches shaped
`[local_device_count, batch_size, ...]`, already placed on the local devices,
so the `jax.pmap`-ed train step consumes them with no further copy.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jdist import errors
from jdist.collectives import context
# Re-exported: the epoch order and partition are part of this module's API.
from jdist.data.epoch_order import batches_per_epoch
from jdist.data.epoch_order import check_int
from jdist.data.epoch_order import check_partition_args
from jdist.data.epoch_order import epoch_order
from jdist.runtime.topology import Topology

Batch = dict[str, Any]

WEIGHT_KEY = "weight"


def _produce(source: Iterator[Batch], place: Callable[[Batch], Batch],
             buffer: queue.Queue, stop: threading.Event) -> None:
  """Prefetch thread body: queues `(kind, payload)` items until done or stopped."""

  def put(item: tuple[str, Any]) -> bool:
    # Polls `stop` so a consumer that went away never leaves us blocked.
    while not stop.is_set():
      try:
        buffer.put(item, timeout=0.05)
        return True
      except queue.Full:
        pass
    return False

  try:
    for batch in source:
      if stop.is_set() or not put(("batch", place(batch))):
        return
    put(("end", None))
  except BaseException as error:  # pylint: disable=broad-except
    put(("error", error))  # Re-raised by the consumer.
  finally:
    source.close()


class PrefetchIterator:
  """Iterates batches that a background thread places on device ahead of use.

  Up to `prefetch` placed batches wait in a queue, so host-side gathering and
  the host-to-device copies of the next steps overlap the current step. An
  exception in the thread is re-raised by `__next__`. `close()` (also run by
  `with` and, as a signal, by garbage collection) stops the thread.
  """

  def __init__(self, source: Iterator[Batch], place: Callable[[Batch], Batch],
               prefetch: int):
    self._buffer: queue.Queue = queue.Queue(maxsize=prefetch)
    self._stop = threading.Event()
    # The thread gets no reference to `self`, so dropping the iterator lets
    # it be collected, and `__del__` then stops the thread.
    self._thread = threading.Thread(
        target=_produce, args=(source, place, self._buffer, self._stop),
        name="jdist-prefetch", daemon=True)
    self._thread.start()

  def __iter__(self) -> PrefetchIterator:
    return self

  def __next__(self) -> Batch:
    while not self._stop.is_set():
      try:
        kind, payload = self._buffer.get(timeout=0.5)
      except queue.Empty:
        if self._thread.is_alive() or not self._buffer.empty():
          continue
        self.close()
        raise RuntimeError("the jdist prefetch thread stopped without a result") from None
      if kind == "batch":
        return payload
      self.close()
      if kind == "error":
        raise payload
      break
    raise StopIteration

  def close(self) -> None:
    """Stops the prefetch thread and drops the batches it placed."""
    self._stop.set()
    while not self._buffer.empty():
      self._buffer.get_nowait()
    self._thread.join(timeout=10.0)

  def __enter__(self) -> PrefetchIterator:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def __del__(self):
    # Only signal here: joining inside garbage collection could stall it.
    if hasattr(self, "_stop"):
      self._stop.set()


def local_sharding(topology: Topology, devices: Sequence[jax.Device] | None) -> NamedSharding:
  """One row of the leading axis per local device: the layout `jax.pmap` takes.

  Args:
    topology: this process's place in the job.
    devices: the local devices; default the first
      `topology.local_device_count` of `jax.local_devices()`.

  Raises:
    jdist.errors.ShapeError: not as many devices as the topology has.
  """
  wanted = topology.local_device_count
  devices = list(devices or jax.local_devices()[:wanted])
  if len(devices) != wanted:
    raise errors.ShapeError(
        f"the topology has {wanted} local devices but {len(devices)} are "
        f"available here; build the Topology with local_device_count="
        f"{len(devices)} or pass devices=.")
  return context.per_device_sharding(devices)


class ShardedLoader:
  """Batches for this process's replicas, placed on its local devices.

  `epoch(e)` yields dicts of arrays `[local_device_count, batch_size, ...]`:
  row `d` holds the next examples of local replica `d`'s index list (see
  `replica_indices`), and the arrays are sharded over the local devices along
  axis 0, the layout `jax.pmap` takes without a copy.

  Every process must pass a dataset of the same size and the same
  `batch_size`, `seed` and `drop_last`: `len(loader)` depends only on those
  and `topology.replica_count`, and a process running one step more or less
  than the others would hang their collectives.

  Training (`drop_last=True`, the default): every batch is full and each
  epoch skips `num_examples % (batch_size * replica_count)` examples (a
  different set each epoch when shuffling). Evaluation
  (`drop_last=False, pad_with_weights=True`): every example is read exactly
  once across all replicas; the short last step is filled with padding, and
  a `"weight"` float32 array `[local_device_count, batch_size]` is 1 for
  real examples and 0 for padding, so weighted metric sums are exact. With
  `drop_last=False` and no weights, padding repeats examples
  (`DistributedSampler` behaviour).

  Args:
    arrays: named arrays sharing the leading (example) dimension.
    batch_size: examples per replica per step.
    topology: this process's place in the job (only its numbers are used to
      partition; batches are placed on `devices`).
    seed: shuffling seed, the same on every process.
    shuffle: draw a new order each epoch; if False, use the dataset order.
    drop_last: see above.
    prefetch: batches a background thread keeps placed on device ahead of
      the consumer; 0 places each batch when it is asked for.
    pad_with_weights: add the `"weight"` array described above.
    transform: optional function applied to each host batch (numpy arrays
      shaped `[local_device_count, batch_size, ...]`) in the prefetch thread
      before placement, e.g. augmentation or normalization.
    devices: the local devices to place batches on; default the first
      `topology.local_device_count` of `jax.local_devices()`.

  Raises:
    ValueError: bad arguments, arrays of different lengths, or a dataset
      too small to give one batch.
  """

  def __init__(self, arrays: Mapping[str, np.ndarray], *, batch_size: int,
               topology: Topology, seed: int = 0, shuffle: bool = True,
               drop_last: bool = True, prefetch: int = 2,
               pad_with_weights: bool = False,
               transform: Callable[[Batch], Batch] | None = None,
               devices: Sequence[jax.Device] | None = None):
    if not arrays:
      raise ValueError("ShardedLoader needs at least one array.")
    lengths = {name: (np.shape(array)[0] if np.ndim(array) else None)
               for name, array in arrays.items()}
    if None in lengths.values() or len(set(lengths.values())) != 1:
      raise ValueError(f"ShardedLoader arrays must share a leading (example) "
                       f"dimension; got leading sizes {lengths}.")
    if pad_with_weights and WEIGHT_KEY in arrays:
      raise ValueError(f"pad_with_weights=True adds a {WEIGHT_KEY!r} array; "
                       f"rename the input array {WEIGHT_KEY!r}.")
    check_int("batch_size", batch_size, 1)
    check_int("prefetch", prefetch, 0)
    check_int("seed", seed, 0)
    self._arrays = dict(arrays)
    self.num_examples = next(iter(lengths.values()))
    self.batch_size = batch_size
    self.topology = topology
    self.seed = seed
    self.shuffle = shuffle
    self.drop_last = drop_last
    self.prefetch = prefetch
    self.pad_with_weights = pad_with_weights
    self.transform = transform
    self._devices = None if devices is None else list(devices)
    self._sharding: NamedSharding | None = None
    check_partition_args(self.num_examples, 0, topology.replica_count, drop_last)
    self._length = batches_per_epoch(
        self.num_examples, batch_size=batch_size,
        replica_count=topology.replica_count, drop_last=drop_last)
    if self._length == 0:
      raise ValueError(
          f"{self.num_examples} examples give no full step of batch_size="
          f"{batch_size} x {topology.replica_count} replicas with "
          f"drop_last=True; use a smaller batch_size or drop_last=False.")

  def __len__(self) -> int:
    """Steps per epoch, the same on every process."""
    return self._length

  def _local_rows(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """Index and weight of every example this process reads in `epoch`.

    Returns:
      `(indices, weights)`, each `[local_device_count, len(self) * batch_size]`.
    """
    replica_count = self.topology.replica_count
    order, is_real = epoch_order(
        self.num_examples, replica_count=replica_count, epoch=epoch,
        seed=self.seed, shuffle=self.shuffle, drop_last=self.drop_last)
    first = self.topology.replica_indices[0]
    local = slice(first, first + self.topology.local_device_count)
    # Position i of replica r is order[i * replica_count + r].
    indices = order.reshape(-1, replica_count).T[local]
    weights = is_real.reshape(-1, replica_count).T[local].astype(np.float32)
    per_replica = self._length * self.batch_size
    if indices.shape[1] >= per_replica:
      return indices[:, :per_replica], weights[:, :per_replica]
    # Fill the short last step with repeats of the replica's first examples,
    # marked as padding (wrapping around if it has fewer than needed).
    padding = np.arange(per_replica - indices.shape[1]) % indices.shape[1]
    pad_indices = indices[:, padding]
    return (np.concatenate([indices, pad_indices], axis=1),
            np.concatenate([weights, np.zeros(pad_indices.shape, np.float32)], axis=1))

  def host_batches(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
    """The batches of `epoch` as numpy arrays on the host, not yet placed.

    Args:
      epoch: epoch number (>= 0).
      start_batch: first step to yield; a run resumed mid-epoch passes the
        steps it already did and gets the rest in the uninterrupted order.

    Yields:
      Dicts of `[local_device_count, batch_size, ...]` numpy arrays.
    """
    check_int("epoch", epoch, 0)
    check_int("start_batch", start_batch, 0)
    if start_batch > self._length:
      raise ValueError(f"start_batch={start_batch} is past the end of an epoch "
                       f"of {self._length} batches.")
    return self._generate(epoch, start_batch)

  def _generate(self, epoch: int, start_batch: int) -> Iterator[Batch]:
    indices, weights = self._local_rows(epoch)
    for step in range(start_batch, self._length):
      columns = slice(step * self.batch_size, (step + 1) * self.batch_size)
      rows = indices[:, columns]
      batch = {name: np.asarray(array[rows.reshape(-1)]).reshape(rows.shape + np.shape(array)[1:])
               for name, array in self._arrays.items()}
      if self.pad_with_weights:
        batch[WEIGHT_KEY] = weights[:, columns]
      if self.transform is not None:
        batch = self.transform(batch)
      yield batch

  def _place(self, batch: Batch) -> Batch:
    if self._sharding is None:
      self._sharding = local_sharding(self.topology, self._devices)
    return jax.device_put(batch, self._sharding)

  def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[Batch]:
    """The batches of `epoch`, placed on the local devices, for `jax.pmap`.

    Args:
      epoch: epoch number (>= 0); selects the shuffle order.
      start_batch: first step to yield (to resume a run mid-epoch).

    Returns:
      An iterator of dicts of device arrays `[local_device_count,
      batch_size, ...]`; close it (or let it go) to stop its prefetch thread.
    """
    source = self.host_batches(epoch, start_batch)
    if self.prefetch == 0:
      return (self._place(batch) for batch in source)
    return PrefetchIterator(source, self._place, self.prefetch)
