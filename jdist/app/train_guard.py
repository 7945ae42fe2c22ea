"""What `jdist train` checks so that nothing goes silently wrong or gets lost.

`jdist.app.train` calls these at start, around checkpoints and while training:

  * `settings_problem`: every process was started with the same settings,
    data and devices (compared once, at start; a rank with another optimizer,
    learning rate or `--train-limit` would otherwise train a different model
    or run a different number of steps);
  * `probe_writable`: the checkpoint directory can be written, before the
    first epoch is spent;
  * `first_nonfinite`: which leaf of the state holds a NaN or an Inf, so a
    non-finite state is never saved over a finite checkpoint;
  * `resume_world`: how a checkpoint written by another number of replicas
    continues here (the same global batch: exactly; else refused, saying
    how);
  * `replica_checksums`: a cheap on-device checksum of each leaf on each
    replica, compared across replicas every N steps and at the end;
  * `DivergenceGuard`: under DiLoCo, whether the training loss keeps rising
    across outer syncs (host-side, from the loss sums the loop reads).

Every function that exchanges is collective: call it on every process.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist.runtime import host

# Settings that may differ per rank without changing what is trained.
PER_RANK_SETTINGS = ("progress", "log_file", "data_dir", "download", "cpu_devices", "timeout")


def digest(*arrays: np.ndarray) -> str:
  """A hex digest of the arrays' shapes, dtypes and bytes."""
  hasher = hashlib.blake2b(digest_size=12)
  for array in arrays:
    hasher.update(str((array.shape, str(array.dtype))).encode())
    hasher.update(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)
  return hasher.hexdigest()


def settings_problem(config, data, topo, steps_per_epoch: int) -> str | None:
  """What differs between the processes' runs, or None (collective).

  Compares every setting that shapes the run (all of `TrainConfig` but
  `PER_RANK_SETTINGS`), the local device count, the data (sizes and a digest
  of the examples) and the steps per epoch.

  Returns:
    A message naming the first differing setting and each rank's value.
  """
  mine = {f"--{name.replace('_', '-')}": value for name, value in config.to_dict().items()
          if name not in PER_RANK_SETTINGS}
  mine.update({
      "local devices": topo.local_device_count,
      "training data": (f"{len(data.train_x)} examples, digest "
                        f"{digest(data.train_x, data.train_y)}"),
      "test data": f"{len(data.test_x)} examples, digest {digest(data.test_x, data.test_y)}",
      "steps per epoch": steps_per_epoch,
  })
  everyone = host.allgather_object(mine, "jdist train: compare settings")
  for name in mine:
    values = [theirs.get(name) for theirs in everyone]
    if len({repr(v) for v in values}) > 1:
      shown = ", ".join(f"rank {rank} {value!r}" for rank, value in enumerate(values))
      return (f"the processes were started with different settings: {name}: {shown}. "
              f"Every rank must train the same run: start them all with the same flags "
              f"and data (one mpirun command line, files every rank reads alike).")
  return None


def probe_writable(directory: str) -> None:
  """Creates `directory` if needed and writes and removes a file in it.

  Raises:
    OSError: with a message that names the directory and the fix.
  """
  probe = os.path.join(directory, f".jdist-write-probe-{os.getpid()}")
  try:
    os.makedirs(directory, exist_ok=True)
    with open(probe, "w", encoding="utf-8") as stream:
      stream.write("jdist")
    os.remove(probe)
  except OSError as err:
    raise OSError(f"{directory} cannot be written ({type(err).__name__}: {err}); rank 0 "
                  f"writes every checkpoint there. Choose a writable --checkpoint-dir "
                  f"(on a filesystem every process reads).") from None


def _to_host(array: jax.Array) -> np.ndarray:
  """This process's rows of a jit result (backend "jax" returns global arrays)."""
  if array.is_fully_addressable:
    return np.asarray(array)
  if array.is_fully_replicated:
    return np.asarray(array.addressable_data(0))
  shards = sorted(array.addressable_shards, key=lambda shard: shard.index[0].start or 0)
  return np.concatenate([np.asarray(shard.data) for shard in shards])


@jax.jit
def _finite_flags(leaves):
  return jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves])


def first_nonfinite(parts: dict[str, Any]) -> str | None:
  """The path of the first floating leaf holding a NaN or an Inf, or None.

  Args:
    parts: named pytrees, checked in the dict's order (e.g. params first).

  Checked on the devices (one small result comes back). Local: every
  process checks its own replicas.
  """
  with_paths = [(f"{name}{jax.tree_util.keystr(path)}", leaf)
                for name, tree in parts.items()
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
                if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact)]
  if not with_paths:
    return None
  flags = _to_host(_finite_flags([leaf for _, leaf in with_paths]))
  bad = [path for (path, _), ok in zip(with_paths, flags) if not ok]
  return bad[0] if bad else None


def resume_world(saved: dict, config, topo) -> tuple[dict, str | None, str | None]:
  """How a checkpoint continues in this world.

  Args:
    saved: the checkpoint's user metadata ("config", "replica_count", ...).
    config: this run's settings.
    topo: this run's topology.

  Returns:
    (saved config to compare with this run's, refusal or None, note or None).
    A checkpoint of another replica count continues exactly when the global
    batch (batch per replica x replicas) is the same: every epoch's order is
    shared by all replicas and a step consumes the next global batch of it,
    so the position carries over and every example is still read once per
    epoch. Otherwise the run is refused, with the flags that would fit.
  """
  saved_config = dict(saved.get("config", {}))
  replicas = saved.get("replica_count", topo.replica_count)
  if replicas == topo.replica_count:
    return saved_config, None, None
  batch = saved_config.get("batch_size", config.batch_size)
  global_batch = batch * replicas
  if config.batch_size * topo.replica_count == global_batch:
    saved_config["batch_size"] = config.batch_size  # per replica; the global batch is kept
    return saved_config, None, (
        f"the checkpoint was written by {replicas} replicas x batch {batch}; this run has "
        f"{topo.replica_count} replicas x batch {config.batch_size}: the same global batch of "
        f"{global_batch}, so the data position carries over exactly")
  fits = (f"pass --batch-size {global_batch // topo.replica_count} to keep the global batch "
          f"of {global_batch}" if global_batch % topo.replica_count == 0 else
          f"no per-replica batch gives the global batch of {global_batch} on "
          f"{topo.replica_count} replicas")
  return saved_config, (
      f"it was written by {replicas} replicas x batch {batch} = {global_batch} examples per "
      f"step, and this run has {topo.replica_count} replicas x batch {config.batch_size} = "
      f"{config.batch_size * topo.replica_count}: the data position and the epoch's split "
      f"would not carry over (examples read twice or never, another global batch). Resume "
      f"with {replicas} replicas, or {fits}."), None


@jax.jit
def _checksums(leaves):
  """Per replica and leaf: (uint32 checksum of the bits, float32 sum)."""
  sums, bits = [], []
  for leaf in leaves:
    rows = leaf.reshape(leaf.shape[0], -1)
    if rows.dtype.itemsize == 4:
      words = jax.lax.bitcast_convert_type(rows, jnp.uint32)
    elif rows.dtype.itemsize == 2:
      words = jax.lax.bitcast_convert_type(rows, jnp.uint16).astype(jnp.uint32)
    else:
      words = rows.astype(jnp.uint32)
    # Position-weighted, wrapping: a swap of two entries changes it too.
    weights = jnp.arange(words.shape[1], dtype=jnp.uint32) * jnp.uint32(2654435761) + 1
    bits.append(jnp.sum(words * weights, axis=1, dtype=jnp.uint32))
    sums.append(jnp.sum(rows.astype(jnp.float32), axis=1))
  return jnp.stack(bits, axis=1), jnp.stack(sums, axis=1)


def replica_checksums(tree: Any) -> tuple[list[str], np.ndarray, np.ndarray]:
  """(leaf paths, [local replicas, leaves] checksums, float32 sums) of a replicated tree.

  Computed on the devices; only two small arrays come back to the host.
  """
  with_paths = [(jax.tree_util.keystr(path), leaf)
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]
  bits, sums = _checksums([leaf for _, leaf in with_paths])
  return [path for path, _ in with_paths], _to_host(bits), _to_host(sums)


def replicas_problem(tree: Any, step: int) -> str | None:
  """Whether every replica (of every process) holds the same `tree` (collective).

  Returns:
    None, or a message naming the first differing leaf and the replicas.
  """
  paths, bits, sums = replica_checksums(tree)
  everyone = host.allgather_object((bits, sums), "jdist train: compare replicas")
  all_bits = np.concatenate([b for b, _ in everyone])  # [replicas, leaves], global order
  all_sums = np.concatenate([s for _, s in everyone])
  for index, path in enumerate(paths):
    differing = [r for r in range(all_bits.shape[0]) if all_bits[r, index] != all_bits[0, index]]
    if differing:
      shown = ", ".join(f"replica {r} sum {all_sums[r, index]:.9g}" for r in differing[:4])
      return (f"replicas diverged by step {step}: the first differing leaf is {path}: "
              f"replica 0 sum {all_sums[0, index]:.9g}, {shown}. Every replica must apply "
              f"the same averaged update: look for a rank started with other settings or "
              f"code, or non-deterministic host input.")
  return None


class DivergenceGuard:
  """Watches the training loss across DiLoCo's outer periods (host-side, cheap).

  It reads only what the loop already reads: each step's global loss sums.
  Every H steps (an outer period: each fragment synced once) it takes the
  mean loss of the last `window` periods, and compares it with the lowest
  such mean so far. The loss has diverged when, at `patience` syncs in a
  row, that mean is above the lowest by `margin` (relative) and `floor`
  (absolute), whichever is larger. A window of several periods keeps a
  healthy run's noise (one lucky period, a bump at a low loss) under the
  threshold. Every process sees the same sums, so every process decides
  alike.

  Args:
    period: H, steps between two outer syncs of a fragment.
    repeat: alarm again after each further `patience` risen windows (the
      run backs off each time); else once, until the mean falls back under
      the threshold.
  """

  def __init__(self, period: int, repeat: bool = False, window: int = 3, patience: int = 2,
               margin: float = 0.5, floor: float = 0.25):
    self.period, self.repeat, self.window, self.patience = period, repeat, window, patience
    self.margin, self.floor = margin, floor
    self.loss, self.weight = 0.0, 0.0
    self.periods = collections.deque(maxlen=window)  # (loss sum, weight sum) per period
    self.lowest, self.above, self.alarmed = math.inf, 0, False
    self.last_mean = None

  def threshold(self) -> float:
    """The windowed mean above which a sync counts as risen."""
    return self.lowest + max(self.margin * self.lowest, self.floor)

  def observe(self, step: int, loss_sum: float, weight_sum: float) -> bool:
    """Adds a step's loss sums; True when the loss has diverged (at a period's end)."""
    self.loss += loss_sum
    self.weight += weight_sum
    if step % self.period or not self.weight:
      return False
    self.periods.append((self.loss, self.weight))
    self.loss, self.weight = 0.0, 0.0
    if len(self.periods) < self.window:
      return False
    mean = sum(loss for loss, _ in self.periods) / sum(weight for _, weight in self.periods)
    self.last_mean = mean
    if mean > self.threshold():
      self.above += 1
    else:
      self.above, self.alarmed = 0, False
    self.lowest = min(self.lowest, mean)
    if self.above < self.patience or (self.alarmed and not self.repeat):
      return False
    # A next alarm needs `window` new periods, then `patience` risen windows.
    self.above, self.alarmed = 0, True
    self.periods.clear()
    return True
