"""grain input pipelines cut for the job: shard options from the topology, batches placed on device.

grain (`pip install 'jdist[data]'`) is the data path jdist recommends: its
`DataLoader` reads any random-access source (ArrayRecord files, TFDS,
in-memory arrays), runs per-example transformations in worker processes
and checkpoints its position exactly. This module fits it to a jdist job:

  * `grain_shard_options()` turns `jdist.init()`'s topology into grain's
    `ShardOptions`: process `p` of `P` reads shard `p` of `P`. The shards
    are contiguous, equal slices of the source (`drop_remainder=True`, the
    default: the last `len(source) % P` examples are never read), so every
    process runs the same number of steps and no collective waits for a
    process that ran out of data.
  * `GrainLoader` builds the per-process `grain.DataLoader` for a *global*
    batch (each process reads `global_batch_size / process_count` examples
    per step from its own shard, shuffled within it each epoch) and places
    each batch as the step wants it: as one array over `jdist.mesh()` for a
    jit step (`jdist.data.batches.place_process_rows`, as `jdist.shard_global_batch`
    places), or with a leading local-device axis for `jdist.data_parallel`
    (`jdist.shard`, as `jdist.ShardedLoader` places).
  * Its iterator's `get_state()` / `set_state()` is the position of the
    batches the step consumed (not of those prefetched), and
    `jdist.CheckpointManager.save(..., data_iterator=it)` keeps every
    process's position with the training state, so a resumed run reads
    exactly the examples the uninterrupted run would have read.

grain itself is imported on first use, so `import jdist` stays light.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jdist.data import batches
from jdist.data import loader as data
from jdist import errors
from jdist.data.epoch_order import check_int
from jdist.runtime import job as job_lib
from jdist.runtime import topology as topology_lib

STYLES = ("global", "replicated")


def _grain():
  """The grain package, or an ImportError that says how to install it."""
  try:
    import grain  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    raise ImportError("jdist's grain input pipeline needs grain: pip install 'jdist[data]' "
                      "(or pip install grain).") from err
  return grain


def _absl_flags_parsed() -> None:
  """Marks absl's flags parsed (with their defaults) if the script has not parsed them.

  grain's worker processes read absl flags, and absl refuses to read flags
  that were never parsed; a script need not use `absl.app` to use workers.
  """
  from absl import flags  # pylint: disable=g-import-not-at-top  (grain's dependency)
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def _topology(topology: topology_lib.Topology | None) -> topology_lib.Topology:
  if topology is None:
    return job_lib.current()
  if not isinstance(topology, topology_lib.Topology):
    raise ValueError(f"topology={topology!r} must be a jdist.Topology or None (jdist.init()'s).")
  return topology


def grain_shard_options(topology: topology_lib.Topology | None = None, *,
                        drop_remainder: bool = True):
  """grain's `ShardOptions` for this process: shard `process_index` of `process_count`.

  Args:
    topology: the job's `jdist.Topology`; default `jdist.init()`'s. Under
      mpirun its process index and count are the MPI rank and size, which
      `jax.process_index()` / `jax.process_count()` also report.
    drop_remainder: True (the default, for training) gives every process a
      shard of `len(source) // process_count` examples, so every process
      runs the same number of steps; the last `len(source) % process_count`
      examples are never read. False spreads them over the first shards,
      which then hold one example more: use it only where the processes
      need not step together (e.g. evaluation with host-side sums).

  Returns:
    A `grain.sharding.ShardOptions`.

  Raises:
    ImportError: grain is not installed.
    ValueError: `topology` is not a `jdist.Topology`.
  """
  topo = _topology(topology)
  return _grain().sharding.ShardOptions(shard_index=topo.process_index,
                                        shard_count=topo.process_count,
                                        drop_remainder=bool(drop_remainder))


class ArraySource:
  """A grain random-access source over named numpy arrays: record `i` is `{name: array[i]}`.

  Its `repr` names only the arrays' shapes and dtypes, so a fresh run's
  source matches the one a checkpointed iterator state was taken from
  (grain compares the two when restoring).

  Args:
    arrays: named arrays sharing the leading (example) dimension.

  Raises:
    ValueError: no arrays, or arrays of different lengths.
  """

  def __init__(self, arrays: Mapping[str, np.ndarray]):
    if not arrays:
      raise ValueError("ArraySource needs at least one array.")
    lengths = {name: (np.shape(array)[0] if np.ndim(array) else None)
               for name, array in arrays.items()}
    if None in lengths.values() or len(set(lengths.values())) != 1:
      raise ValueError(f"ArraySource arrays must share a leading (example) dimension; "
                       f"got leading sizes {lengths}.")
    self._arrays = {name: np.asarray(array) for name, array in arrays.items()}
    self._length = next(iter(lengths.values()))

  def __len__(self) -> int:
    return self._length

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    return {name: array[index] for name, array in self._arrays.items()}

  def __repr__(self) -> str:
    fields = ", ".join(f"{name}={array.dtype}{list(array.shape)}"
                       for name, array in self._arrays.items())
    return f"ArraySource({fields})"


class GrainLoader:
  """This process's part of every global batch, read by grain and placed on device.

  `iter(loader)` gives a `GrainIterator`: an endless stream of batches (or
  `num_epochs` epochs) whose position `get_state()` / `set_state()` save and
  restore (see `jdist.CheckpointManager`'s `data_iterator=`).

  With `style="global"` (jit steps) a batch is a pytree of arrays of
  leading size `global_batch_size` over the data axis of `jdist.mesh()`
  (with the "jax" backend; otherwise of this process's
  `global_batch_size / process_count` rows over its local devices, the
  same layout `jdist.shard_global_batch` gives). With `style="replicated"`
  (`jdist.data_parallel` steps) leaves are `[local_device_count,
  global_batch_size / replica_count, ...]`, one row per local device. Rows
  are in process-major replica order, so the replicas together see exactly
  the global batch that one device would see.

  Args:
    source: a mapping of numpy arrays sharing their leading dimension
      (wrapped in `ArraySource`), or any grain random-access source (`len`
      and `__getitem__`; give it a `repr` that does not change between runs
      for checkpointed iterators to restore).
    global_batch_size: examples per step over all processes; a multiple of
      the replica count (processes x local devices).
    topology: the job's `jdist.Topology`; default `jdist.init()`'s.
    seed: shuffling seed (the same on every process).
    shuffle: reshuffle each process's shard every epoch.
    num_epochs: epochs to read; None reads forever.
    operations: grain transformations applied per example before batching
      (e.g. `grain.transforms.Map` subclasses for augmentation).
    worker_count: grain worker processes (0 reads in this process).
    style: "global" or "replicated" (see above).
    prefetch: placed batches a background thread keeps ready; 0 places each
      batch when it is asked for. The saved position is always the one
      after the last batch handed out.
    read_options: grain's `ReadOptions` (reader threads and buffer per
      process); default grain's, except for in-memory arrays, which are read
      without threads (grain's advice: its 16 threads only contend for the
      GIL there; see docs/data.md for the measured cost).
    devices: with `style="replicated"`, the local devices to place rows on;
      default the first `topology.local_device_count` of `jax.local_devices()`.

  Raises:
    ImportError: grain is not installed.
    ValueError: a bad argument, named with its value, or a source too small
      to give one step.
  """

  def __init__(self, source: Any, *, global_batch_size: int,
               topology: topology_lib.Topology | None = None, seed: int = 0,
               shuffle: bool = True, num_epochs: int | None = None,
               operations: Sequence[Any] = (), worker_count: int = 0,
               style: str = "global", prefetch: int = 2, read_options: Any = None,
               devices: Sequence[jax.Device] | None = None):
    grain = _grain()
    self.topology = _topology(topology)
    check_int("global_batch_size", global_batch_size, 1)
    check_int("seed", seed, 0)
    check_int("worker_count", worker_count, 0)
    check_int("prefetch", prefetch, 0)
    if num_epochs is not None:
      check_int("num_epochs", num_epochs, 1)
    if style not in STYLES:
      raise ValueError(f"style={style!r} must be one of {STYLES}: 'global' for jit steps "
                       f"over jdist.mesh(), 'replicated' for jdist.data_parallel steps.")
    replicas = self.topology.replica_count
    if global_batch_size % replicas:
      lower = global_batch_size // replicas * replicas
      raise ValueError(
          f"global_batch_size={global_batch_size} is not divisible by the {replicas} "
          f"replicas ({self.topology.process_count} processes x "
          f"{self.topology.local_device_count} devices); use a multiple of {replicas}, "
          f"e.g. {lower or replicas} or {lower + replicas}.")
    if isinstance(source, Mapping):
      source = ArraySource(source)
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
      raise ValueError(f"source={source!r} must be a mapping of numpy arrays or a grain "
                       f"random-access source (len() and [index]).")
    self.source = source
    self.global_batch_size = global_batch_size
    self.process_batch_size = global_batch_size // self.topology.process_count
    self.style = style
    self.prefetch = prefetch
    self.shard_options = grain_shard_options(self.topology)
    shard_size = len(source) // self.topology.process_count
    # Shards are equal (drop_remainder), so this count is every process's.
    self.steps_per_epoch = shard_size // self.process_batch_size
    if not self.steps_per_epoch:
      raise ValueError(
          f"the source's {len(source)} examples give each of the "
          f"{self.topology.process_count} processes {shard_size}, fewer than its "
          f"{self.process_batch_size} per step (global_batch_size={global_batch_size}); "
          f"use a smaller global_batch_size.")
    sampler = grain.samplers.IndexSampler(
        num_records=len(source), shard_options=self.shard_options, shuffle=shuffle,
        num_epochs=num_epochs, seed=seed)
    if worker_count:
      _absl_flags_parsed()
    if read_options is None and isinstance(source, ArraySource):
      read_options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    # drop_remainder: a short batch would not split over the devices, and a
    # process taking an extra step would leave the others' collectives waiting.
    self.data_loader = grain.DataLoader(
        data_source=source, sampler=sampler, read_options=read_options,
        operations=list(operations) + [grain.transforms.Batch(
            self.process_batch_size, drop_remainder=True)],
        worker_count=worker_count, shard_options=self.shard_options)
    self._devices = None if devices is None else list(devices)
    self._sharding = None

  def place(self, rows: Any) -> Any:
    """Places one host batch of this process's rows the way `style` asks."""
    if self.style == "global":
      return batches.place_process_rows(rows, self.topology)
    if self._sharding is None:
      self._sharding = data.local_sharding(self.topology, self._devices)
    return jax.device_put(batches.shard_batch(rows, self.topology.local_device_count),
                          self._sharding)

  def __iter__(self) -> GrainIterator:
    return GrainIterator(self)


def _with_states(iterator) -> Any:
  """(batch, position after it): the position travels with its prefetched batch."""
  for batch in iterator:
    yield batch, iterator.get_state()


class GrainIterator:
  """Placed batches of a `GrainLoader`, with the position of the last one handed out.

  Raises:
    StopIteration: after `num_epochs` epochs.
  """

  def __init__(self, loader: GrainLoader):
    self._loader = loader
    self._grain = iter(loader.data_loader)
    self._state = self._grain.get_state()
    self._prefetch: data.PrefetchIterator | None = None

  def __iter__(self) -> GrainIterator:
    return self

  def __next__(self) -> Any:
    loader = self._loader
    if not loader.prefetch:
      rows = next(self._grain)
      self._state = self._grain.get_state()
      return loader.place(rows)
    if self._prefetch is None:
      self._prefetch = data.PrefetchIterator(
          _with_states(self._grain), lambda item: (loader.place(item[0]), item[1]),
          loader.prefetch)
    batch, self._state = next(self._prefetch)
    return batch

  def get_state(self) -> bytes:
    """grain's state for the position after the last batch handed out."""
    return self._state

  def set_state(self, state: bytes) -> None:
    """Moves to a position `get_state()` gave (drops any prefetched batches)."""
    self.close()
    self._grain.set_state(state)
    self._state = self._grain.get_state()

  def close(self) -> None:
    """Stops the prefetch thread, if one runs; iterating again restarts it."""
    if self._prefetch is not None:
      self._prefetch.close()
      self._prefetch = None


# Checkpointed positions (`jdist.CheckpointManager`'s `data_iterator=`) -----


def encode_position(iterator: Any) -> dict | None:
  """`iterator.get_state()` as plain JSON, for the checkpoint record (None: no iterator).

  grain's `DataLoader` iterators give JSON bytes, its dataset iterators a
  dict; both round-trip through `restore_position`.

  Raises:
    ValueError: `iterator` has no `get_state` / `set_state`.
  """
  if iterator is None:
    return None
  if not (callable(getattr(iterator, "get_state", None))
          and callable(getattr(iterator, "set_state", None))):
    raise ValueError(f"data_iterator={iterator!r} needs get_state() and set_state(), like "
                     f"the iterators of jdist.GrainLoader and grain.DataLoader.")
  state = iterator.get_state()
  if isinstance(state, bytes):
    return {"bytes": state.decode()}
  return {"json": json.loads(json.dumps(state))}


def restore_position(iterator: Any, record: dict, path: Any, topo) -> None:
  """Puts `iterator` at this process's position stored in a checkpoint record.

  Raises:
    jdist.errors.CheckpointError: the checkpoint holds no position for this
      process, or grain refuses it (another pipeline or source).
  """
  if iterator is None:
    return
  positions = record.get("data_iterators") or []
  if len(positions) != topo.process_count or positions[topo.process_index] is None:
    saved = ("no data iterator position (it was saved without data_iterator=)"
             if not any(positions) else
             f"the data iterator positions of {len(positions)} processes")
    raise errors.CheckpointError(
        f"{path} holds {saved}, and this run has {topo.process_count} processes: each "
        f"process's position is its own, so it resumes exactly only with as many. Restore "
        f"without data_iterator= and start the data where you choose.")
  position = positions[topo.process_index]
  state = position["bytes"].encode() if "bytes" in position else position["json"]
  try:
    iterator.set_state(state)
  except Exception as err:  # pylint: disable=broad-except
    raise errors.CheckpointError(
        f"{path}: the data iterator refused the saved position ({type(err).__name__}: "
        f"{str(err)[:300]}); build the pipeline (source, sampler, shard options) as the "
        f"saved run did.") from err
