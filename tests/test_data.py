"""Tests of jdist.data: per-replica partitioning and the sharded loader.

Several processes are simulated by building `Topology` objects for each rank
directly: partitioning only needs the topology's numbers. Device placement
uses this process's local devices (4 under plain pytest).
"""

import collections
import gc
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jdist.data import batches as batches_lib
from jdist import data
from jdist import errors
from jdist.runtime.topology import Topology

SIZES = (101, 37)
REPLICA_COUNTS = tuple(range(1, 9))


def _all_ranks(num_examples, replica_count, **kwargs):
  return [data.replica_indices(num_examples, replica_index=r,
                               replica_count=replica_count, **kwargs)
          for r in range(replica_count)]


def _index_loader(num_examples, topology, **kwargs):
  """A loader whose "index" array says which example each row holds."""
  arrays = {"index": np.arange(num_examples),
            "x": np.arange(num_examples * 2, dtype=np.float32).reshape(num_examples, 2)}
  return data.ShardedLoader(arrays, topology=topology, **kwargs)


def _process_topologies(process_count, local_device_count):
  return [Topology(process_index=p, process_count=process_count,
                   local_device_count=local_device_count)
          for p in range(process_count)]


# --- epoch_permutation / replica_indices -----------------------------------


def test_epoch_permutation_is_deterministic_permutation():
  perm = data.epoch_permutation(101, epoch=3, seed=7)
  np.testing.assert_array_equal(np.sort(perm), np.arange(101))
  np.testing.assert_array_equal(perm, data.epoch_permutation(101, epoch=3, seed=7))


def test_different_epochs_and_seeds_give_different_orders():
  orders = [data.epoch_permutation(101, epoch=e, seed=s).tolist()
            for e in range(4) for s in range(3)]
  assert len({tuple(o) for o in orders}) == len(orders)
  # Seeding with the (seed, epoch) pair keeps these apart.
  assert not np.array_equal(data.epoch_permutation(50, epoch=1, seed=0),
                            data.epoch_permutation(50, epoch=0, seed=1))


@pytest.mark.parametrize("num_examples", SIZES)
@pytest.mark.parametrize("replica_count", REPLICA_COUNTS)
def test_padding_covers_every_example(num_examples, replica_count):
  per_rank = _all_ranks(num_examples, replica_count, epoch=2, seed=1)
  expected_length = -(-num_examples // replica_count)
  assert {len(rank) for rank in per_rank} == {expected_length}
  counts = collections.Counter(np.concatenate(per_rank).tolist())
  assert set(counts) == set(range(num_examples))
  # Only the padding repeats examples: the first ones of the shared order.
  padding = expected_length * replica_count - num_examples
  repeated = sorted(i for i, count in counts.items() if count == 2)
  first = data.epoch_permutation(num_examples, epoch=2, seed=1)[:padding]
  assert repeated == sorted(first.tolist())
  assert max(counts.values()) <= 2


@pytest.mark.parametrize("num_examples", SIZES)
@pytest.mark.parametrize("replica_count", REPLICA_COUNTS)
def test_drop_last_never_repeats(num_examples, replica_count):
  per_rank = _all_ranks(num_examples, replica_count, epoch=2, seed=1, drop_last=True)
  assert {len(rank) for rank in per_rank} == {num_examples // replica_count}
  seen = np.concatenate(per_rank)
  assert len(set(seen.tolist())) == len(seen)
  assert num_examples - len(seen) == num_examples % replica_count


@pytest.mark.parametrize("replica_count", (1, 3, 8))
def test_ranks_share_one_order(replica_count):
  # Interleaving every rank's slice rebuilds the one shared permutation.
  per_rank = _all_ranks(101, replica_count, epoch=5, seed=3, drop_last=True)
  interleaved = np.stack(per_rank, axis=1).reshape(-1)
  np.testing.assert_array_equal(interleaved,
                                data.epoch_permutation(101, epoch=5, seed=3)[:len(interleaved)])


def test_epochs_reorder_each_rank():
  first = data.replica_indices(101, replica_index=1, replica_count=4, epoch=0)
  second = data.replica_indices(101, replica_index=1, replica_count=4, epoch=1)
  assert not np.array_equal(first, second)


def test_no_shuffle_is_strided_range():
  np.testing.assert_array_equal(
      data.replica_indices(10, replica_index=1, replica_count=4, shuffle=False),
      [1, 5, 9])
  # Padding repeats from the start of the order: 10, 11 -> 0, 1.
  np.testing.assert_array_equal(
      data.replica_indices(10, replica_index=3, replica_count=4, shuffle=False),
      [3, 7, 1])


def test_fewer_examples_than_replicas_pads_cyclically():
  per_rank = _all_ranks(3, 8, shuffle=False)
  assert [rank.tolist() for rank in per_rank] == [[0], [1], [2], [0], [1], [2], [0], [1]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(replica_index=4, replica_count=4), "replica_index=4 is out of range"),
    (dict(replica_index=-1, replica_count=4), "replica_index=-1"),
    (dict(replica_index=0, replica_count=0), "replica_count=0"),
    (dict(replica_index=0, replica_count=2, epoch=-1), "epoch=-1"),
    (dict(replica_index=0, replica_count=2, seed=1.5), "seed=1.5"),
    (dict(replica_index=0, replica_count=200, drop_last=True), "drop_last=False"),
])
def test_replica_indices_rejects_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    data.replica_indices(101, **kwargs)


def test_batches_per_epoch():
  assert data.batches_per_epoch(101, batch_size=5, replica_count=4) == 5
  assert data.batches_per_epoch(101, batch_size=5, replica_count=4, drop_last=False) == 6
  assert data.batches_per_epoch(19, batch_size=5, replica_count=4) == 0
  assert data.batches_per_epoch(40, batch_size=5, replica_count=4, drop_last=False) == 2


# --- ShardedLoader: partitioning across simulated processes ----------------


@pytest.mark.parametrize("num_examples", SIZES)
@pytest.mark.parametrize("process_count, local_device_count", [
    (1, 1), (1, 4), (2, 1), (2, 2), (3, 2), (2, 4), (1, 7), (8, 1)])
@pytest.mark.parametrize("batch_size", (3, 8))
def test_eval_loader_reads_every_example_exactly_once(
    num_examples, process_count, local_device_count, batch_size):
  weighted = collections.Counter()
  lengths = set()
  for topology in _process_topologies(process_count, local_device_count):
    loader = _index_loader(num_examples, topology, batch_size=batch_size,
                           drop_last=False, pad_with_weights=True, seed=4)
    batches = list(loader.host_batches(epoch=1))
    lengths.add(len(batches))
    assert len(batches) == len(loader)
    for batch in batches:
      assert batch["index"].shape == (local_device_count, batch_size)
      assert batch["x"].shape == (local_device_count, batch_size, 2)
      assert batch["weight"].dtype == np.float32
      np.testing.assert_array_equal(batch["x"][..., 0], 2 * batch["index"])
      for index, weight in zip(batch["index"].ravel(), batch["weight"].ravel()):
        assert weight in (0.0, 1.0)
        weighted[int(index)] += weight
  # Every process runs the same number of steps, or collectives would hang.
  assert len(lengths) == 1
  assert weighted == collections.Counter({i: 1.0 for i in range(num_examples)})


@pytest.mark.parametrize("num_examples", SIZES)
@pytest.mark.parametrize("process_count, local_device_count", [(1, 1), (1, 4), (2, 2), (3, 1)])
def test_train_loader_drops_only_the_documented_remainder(
    num_examples, process_count, local_device_count):
  batch_size = 4
  seen = []
  for topology in _process_topologies(process_count, local_device_count):
    loader = _index_loader(num_examples, topology, batch_size=batch_size)
    for batch in loader.host_batches(epoch=0):
      seen.extend(batch["index"].ravel().tolist())
  replica_count = process_count * local_device_count
  assert len(seen) == len(set(seen))
  assert num_examples - len(seen) == num_examples % (batch_size * replica_count)


def test_processes_read_different_examples():
  topologies = _process_topologies(2, 2)
  first, second = (next(_index_loader(101, t, batch_size=4).host_batches(0))["index"]
                   for t in topologies)
  assert not set(first.ravel()) & set(second.ravel())


def test_start_batch_resumes_the_same_order():
  loader = _index_loader(101, Topology(1, 2, 2), batch_size=3, drop_last=False,
                         pad_with_weights=True)
  full = list(loader.host_batches(epoch=3))
  resumed = list(loader.host_batches(epoch=3, start_batch=4))
  assert len(resumed) == len(full) - 4
  for expected, got in zip(full[4:], resumed):
    for key in expected:
      np.testing.assert_array_equal(expected[key], got[key])
  assert list(loader.host_batches(epoch=3, start_batch=len(loader))) == []
  with pytest.raises(ValueError, match="past the end"):
    loader.host_batches(epoch=3, start_batch=len(loader) + 1)


def test_loader_rejects_bad_arguments():
  topology = Topology(0, 1, 2)
  with pytest.raises(ValueError, match="leading"):
    data.ShardedLoader({"x": np.zeros(10), "y": np.zeros(11)}, batch_size=2, topology=topology)
  with pytest.raises(ValueError, match="rename"):
    data.ShardedLoader({"weight": np.zeros(10)}, batch_size=2, topology=topology,
                       pad_with_weights=True)
  with pytest.raises(ValueError, match="batch_size=0"):
    data.ShardedLoader({"x": np.zeros(10)}, batch_size=0, topology=topology)
  with pytest.raises(ValueError, match="no full step"):
    data.ShardedLoader({"x": np.zeros(10)}, batch_size=8, topology=topology)


# --- ShardedLoader: device placement and prefetching -----------------------


@pytest.fixture
def local_topology():
  return Topology(process_index=0, process_count=1,
                  local_device_count=jax.local_device_count())


def test_loader_batches_feed_pmap_without_copies(local_topology):
  local = local_topology.local_device_count
  images = np.random.default_rng(0).random((37, 8, 8, 1), dtype=np.float32)
  labels = np.arange(37, dtype=np.int32) % 10
  loader = data.ShardedLoader({"image": images, "label": labels}, batch_size=5,
                              topology=local_topology, drop_last=False,
                              pad_with_weights=True)
  step = jax.pmap(lambda b: (jnp.sum(b["image"].sum(axis=(1, 2, 3)) * b["weight"]),
                             b["weight"].sum()), axis_name="data")
  total, count = 0.0, 0.0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for batch in loader.epoch(0):
      assert batch["image"].shape == (local, 5, 8, 8, 1)
      assert batch["label"].shape == (local, 5)
      assert batch["weight"].shape == (local, 5)
      assert isinstance(batch["image"].sharding, NamedSharding)
      assert [s.device for s in batch["image"].addressable_shards] == jax.local_devices()
      # 'disallow' fails on any host->device or device->device copy pmap
      # would need, so this checks the batch is already where pmap wants it.
      with jax.transfer_guard("disallow"):
        sums, counts = step(batch)
        sums.block_until_ready()
      total += float(np.sum(sums))
      count += float(np.sum(counts))
  assert count == 37
  np.testing.assert_allclose(total, images.sum(), rtol=1e-5)


@pytest.mark.parametrize("prefetch", (0, 1, 3))
def test_device_batches_match_host_batches(local_topology, prefetch):
  loader = _index_loader(101, local_topology, batch_size=4, prefetch=prefetch)
  placed = list(loader.epoch(2, start_batch=1))
  host = list(loader.host_batches(2, start_batch=1))
  assert len(placed) == len(host) == len(loader) - 1
  for want, got in zip(host, placed):
    np.testing.assert_array_equal(want["x"], np.asarray(got["x"]))


def test_too_few_local_devices_is_a_shape_error():
  topology = Topology(0, 1, jax.local_device_count() + 1)
  loader = _index_loader(101, topology, batch_size=2, prefetch=0)
  with pytest.raises(errors.ShapeError, match="local_device_count="):
    next(loader.epoch(0))


def test_prefetch_error_reaches_the_consumer(local_topology):
  seen = []

  def transform(batch):
    seen.append(None)
    if len(seen) == 3:
      raise KeyError("augmentation failed")
    return batch

  loader = _index_loader(101, local_topology, batch_size=2, transform=transform)
  iterator = loader.epoch(0)
  next(iterator)
  next(iterator)
  with pytest.raises(KeyError, match="augmentation failed"):
    next(iterator)
  with pytest.raises(StopIteration):
    next(iterator)
  assert not iterator._thread.is_alive()


def test_prefetch_thread_stops_when_iterator_is_dropped(local_topology):
  loader = _index_loader(101, local_topology, batch_size=1, prefetch=2)
  iterator = loader.epoch(0)
  next(iterator)
  thread = iterator._thread
  del iterator
  gc.collect()
  thread.join(timeout=5)
  assert not thread.is_alive()

  for _ in loader.epoch(1):
    break  # The loop drops the iterator.
  gc.collect()
  prefetch_threads = [t for t in threading.enumerate() if t.name == "jdist-prefetch"]
  for prefetch_thread in prefetch_threads:
    prefetch_thread.join(timeout=5)
  assert not any(t.is_alive() for t in prefetch_threads)

  with loader.epoch(2) as iterator:
    next(iterator)
  assert not iterator._thread.is_alive()


# --- shard_batch -------------------------------------------------------------


def test_shard_batch_splits_the_leading_axis():
  batch = {"x": np.arange(24).reshape(8, 3), "y": np.arange(8)}
  sharded = batches_lib.shard_batch(batch, 4)
  assert sharded["x"].shape == (4, 2, 3)
  np.testing.assert_array_equal(sharded["y"], [[0, 1], [2, 3], [4, 5], [6, 7]])


def test_shard_batch_names_size_devices_and_fix():
  with pytest.raises(errors.ShapeError) as info:
    batches_lib.shard_batch({"x": np.zeros((30, 2))}, 4)
  message = str(info.value)
  assert "30" in message and "4 local devices" in message
  assert "multiple of 4, e.g. 28 or 32" in message
  with pytest.raises(errors.ShapeError, match="same leading batch dimension"):
    batches_lib.shard_batch({"x": np.zeros(8), "y": np.zeros(4)}, 4)
