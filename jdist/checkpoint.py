"""Checkpoints of replicated training state, written by rank 0 with orbax.

The state a data-parallel job trains is *replicated*: every leaf carries a
leading local-device axis (`jdist.replicate`). Its replicas are not always
equal: the error-feedback residuals of `jdist.topk`/`jdist.threshold` and the
parameters under `jdist.partial_sync` differ per replica. A checkpoint keeps
every replica's copy, so resuming is exact:

  * `save` compares the copies (bytes on each process, a digest across
    processes). A leaf equal on every replica is stored once, with a leading
    axis of 1; the others are gathered to rank 0 and stored with a leading
    [replica_count] axis, in global replica order.
  * Rank 0 writes with orbax's synchronous `Checkpointer`: into
    `<directory>/<step>.orbax-checkpoint-tmp`, renamed to `<directory>/<step>`
    once complete (orbax's `AtomicRenameTemporaryPath`). A writer killed
    midway leaves only the temporary directory, which `latest_step` and
    `restore` ignore and the next save of that step replaces.
  * The other processes wait until rank 0 reports the outcome, so nobody runs
    ahead and a failed write raises on every rank.
  * `restore` runs on every process, each reading the files itself: the
    directory must be on a filesystem every process sees (shared across
    nodes). Each process takes its own replicas' slices
    (`Topology.replica_indices`) and gets the replicated layout back.

A JSON record stored in the same atomic step directory holds the world it
was written by, a fingerprint of the state (paths, shapes, dtypes) and the
user's metadata. A checkpoint restores into another number of replicas only
when every leaf was equal on every replica (plain `jdist.dist_opt`).

Every method is collective: call it on every process, in the same order.
Only rank 0 calls orbax to write, and it tells orbax that it is a world of
its own (`active_processes={this process}`), so orbax adds no barriers of its
own under either backend (under MPI every rank is JAX process 0; under
backend "jax" the other ranks never enter orbax's save). The other ranks wait
for rank 0 under jdist's watchdog deadline: raise `jdist.init(timeout=...)`
if writing a checkpoint can take longer.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import operator
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jdist import errors
from jdist import topology as topology_lib
from jdist.collectives import host
from jdist.collectives import ops
from jdist.collectives.transport import DATA_AXIS

log = logging.getLogger(__name__)

FORMAT = "jdist-checkpoint"
FORMAT_VERSION = 1
_ARRAYS = "state"      # orbax item: the stored arrays
_RECORD = "jdist"      # orbax item: the JSON record
_GATHER_BYTES = 64 << 20  # per-process payload of one gather to rank 0


def _leaf_name(index: int) -> str:
  return f"leaf_{index:05d}"


def _is_key(dtype) -> bool:
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _signature(tree: Any, devices: int, what: str) -> tuple[list, list]:
  """(leaves, [[path, per-replica shape, dtype], ...]) of a replicated tree."""
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  signature = []
  for path, leaf in with_paths:
    shape = tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)
    if not shape or shape[0] != devices:
      got = "a scalar" if not shape else f"leading size {shape[0]}"
      raise errors.ShapeError(
          f"{what}: leaf {jax.tree_util.keystr(path)} has {got}, but a replicated "
          f"state has a leading axis of {devices} (one copy per local device). Pass "
          f"the state your data_parallel step uses (jdist.replicate(...) of it).")
    signature.append([jax.tree_util.keystr(path), list(shape[1:]), str(leaf.dtype)])
  return [leaf for _, leaf in with_paths], signature


def fingerprint(signature: list) -> str:
  """A digest of a state's structure, shapes and dtypes."""
  return hashlib.sha256(json.dumps(signature).encode()).hexdigest()


def _json_default(value):
  if isinstance(value, (np.generic, np.ndarray, jax.Array)):
    return np.asarray(value).tolist()
  raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _encode_metadata(metadata: Any) -> tuple[dict | None, str | None]:
  if metadata is None:
    return {}, None
  if not isinstance(metadata, dict):
    return None, f"metadata must be a dict, got {type(metadata).__name__}"
  try:
    return json.loads(json.dumps(metadata, default=_json_default)), None
  except (TypeError, ValueError) as err:
    return None, (f"metadata must be JSON-serializable (numbers, strings, lists, "
                  f"dicts; numpy scalars are converted): {err}")


def _local_summary(array: np.ndarray, digest: bool) -> str | None:
  """None if this process's local replicas differ, else a digest of its copy.

  Replicas compare as bytes (NaN equals NaN). The digest, compared across
  processes, is skipped in a single process.
  """
  if not array.size:
    return "empty"
  flat = np.ascontiguousarray(array).reshape(array.shape[0], -1).view(np.uint8)
  if any(not np.array_equal(flat[d], flat[0]) for d in range(1, flat.shape[0])):
    return None
  return hashlib.blake2b(flat[0].tobytes(), digest_size=16).hexdigest() if digest else "equal"


def _gather_to_rank0(host_leaves: list, ids: list[int], topo) -> dict[int, np.ndarray]:
  """Every process's [local_devices, ...] copy of leaves `ids`, as [replicas, ...] on rank 0.

  Leaves travel as flat segments, at most `_GATHER_BYTES` per process and
  exchange, so no message grows with the model. (`allgather_object` hands
  every process every payload; a gather to rank 0 alone would halve the
  traffic, but this runs once per checkpoint.)
  """
  if topo.process_count == 1:
    return {i: host_leaves[i] for i in ids}
  segments = []  # (leaf id, start, stop) in elements of the flattened leaf
  for i in ids:
    count = max(1, _GATHER_BYTES // host_leaves[i].itemsize)
    segments += [(i, start, min(start + count, host_leaves[i].size))
                 for start in range(0, host_leaves[i].size, count)]
  pieces = {i: [[] for _ in range(topo.process_count)] for i in ids}
  bucket, size = [], 0
  for index, (i, start, stop) in enumerate(segments):
    bucket.append((i, start, stop))
    size += (stop - start) * host_leaves[i].itemsize
    if size < _GATHER_BYTES and index + 1 < len(segments):
      continue
    payload = [host_leaves[i].reshape(-1)[start:stop] for i, start, stop in bucket]
    everyone = host.allgather_object(payload, "jdist checkpoint: gather to rank 0")
    for process, arrays in enumerate(everyone):
      for (i, _, _), array in zip(bucket, arrays):
        pieces[i][process].append(array)
    bucket, size = [], 0
  if not topo.is_primary:
    return {}
  return {i: np.concatenate([np.concatenate(p).reshape(host_leaves[i].shape)
                             for p in pieces[i]]) for i in ids}


def _put_local(stacked: np.ndarray, devices: list, key_impl: str | None) -> jax.Array:
  """[devices, ...] host array → one slice per local device, as jdist.replicate lays it out."""
  sharding = NamedSharding(Mesh(np.array(devices), (DATA_AXIS,)), PartitionSpec(DATA_AXIS))
  pieces = [jax.device_put(stacked[d:d + 1], device) for d, device in enumerate(devices)]
  array = jax.make_array_from_single_device_arrays(stacked.shape, sharding, pieces)
  return array if key_impl is None else jax.random.wrap_key_data(array, impl=key_impl)


class CheckpointManager:
  """Saves and restores replicated training state; rank 0 writes, everyone reads.

  Every method is collective: call it on every process, in the same order.
  The directory must be on a filesystem every process can read.

  Example:
    ```python
    manager = jdist.CheckpointManager("/shared/run1/ckpt", keep=3)
    state = {"params": params, "opt_state": opt_state}   # replicated
    if manager.latest_step() is not None:
      state, meta = manager.restore(state)
      start = meta["step"] + 1
    ...
    manager.save(step, state, metadata={"step": step, "epoch": epoch})
    ```

  Args:
    directory: where step directories `<directory>/<step>` are kept.
    keep: newest checkpoints to keep (older ones are deleted after a save);
      None keeps all.
    topology: the job's topology; default `jdist.init()`.

  Raises:
    ValueError: a bad `keep`, or a topology that is not this process's.
  """

  def __init__(self, directory: Any, *, keep: int | None = 3,
               topology: topology_lib.Topology | None = None):
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
      raise ValueError(f"keep={keep!r} must be an int >= 1 (checkpoints to keep) or None "
                       f"(keep all).")
    # orbax refuses relative paths; every rank resolves from its own cwd.
    self.directory = epath.Path(os.path.abspath(os.fspath(directory))) if isinstance(
        directory, (str, os.PathLike)) else epath.Path(directory)
    self.keep = keep
    self.topology = topology or topology_lib.init()
    real = topology_lib.init()
    if (self.topology.process_count, self.topology.process_index) != (
        real.process_count, real.process_index) or (
            self.topology.local_device_count > jax.local_device_count()):
      raise ValueError(f"topology={self.topology} does not describe this process "
                       f"({real}); leave topology=None to use jdist.init()'s.")
    # This process is its own orbax world (see the module doc).
    me = ocp.options.MultiprocessingOptions(primary_host=jax.process_index(),
                                            active_processes={jax.process_index()})
    self._checkpointer = ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            composite_options=ocp.CompositeOptions(multiprocessing_options=me),
            **{_ARRAYS: ocp.PyTreeCheckpointHandler(multiprocessing_options=me),
               _RECORD: ocp.JsonCheckpointHandler(multiprocessing_options=me)}),
        multiprocessing_options=me)

  def __repr__(self) -> str:
    return f"jdist.CheckpointManager({str(self.directory)!r}, keep={self.keep})"

  # Steps ------------------------------------------------------------------

  def _local_steps(self) -> list[int]:
    return sorted(ocp.path.step.checkpoint_steps(self.directory))

  def _from_rank0(self, compute, label: str):
    """Rank 0's result of `compute()` on every process; its error raised everywhere."""
    result, error = None, None
    if self.topology.is_primary:
      try:
        result = compute()
      except errors.CheckpointError as err:
        error = str(err)
      except Exception as err:  # pylint: disable=broad-except
        error = f"{self.directory}: {type(err).__name__}: {err}"
    result, error = host.allgather_object((result, error), label)[0]
    if error is not None:
      raise errors.CheckpointError(error)
    return result

  def all_steps(self) -> list[int]:
    """Steps of complete checkpoints, oldest first (as rank 0 sees them)."""
    return self._from_rank0(self._local_steps, "jdist checkpoint: list steps")

  def latest_step(self) -> int | None:
    """The newest complete checkpoint's step, or None if there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _resolve_step(self, step: int | None) -> int:
    if not self.directory.exists():
      raise errors.CheckpointError(f"No checkpoint directory at {self.directory}.")
    steps = self._local_steps()
    if step is None:
      if not steps:
        raise errors.CheckpointError(
            f"No complete checkpoint in {self.directory} (unfinished "
            f"*.orbax-checkpoint-tmp directories of killed writers are ignored).")
      return steps[-1]
    if step not in steps:
      raise errors.CheckpointError(
          f"No complete checkpoint of step {step} in {self.directory}; complete steps: "
          f"{steps}.")
    return step

  def _read_record(self, step: int) -> dict:
    path = self.directory / str(step)
    try:
      record = self._checkpointer.restore(
          path, args=ocp.args.Composite(**{_RECORD: ocp.args.JsonRestore()}))[_RECORD]
    except Exception as err:  # pylint: disable=broad-except
      raise errors.CheckpointError(
          f"{path} is not a readable jdist checkpoint ({type(err).__name__}: {err}).") from err
    if not isinstance(record, dict) or record.get("format") != FORMAT:
      raise errors.CheckpointError(f"{path} was not written by jdist.CheckpointManager.")
    if record.get("version", 0) > FORMAT_VERSION:
      raise errors.CheckpointError(
          f"{path} has checkpoint format version {record['version']}; this jdist reads up "
          f"to {FORMAT_VERSION}. Upgrade jdist.")
    return record

  def read_metadata(self, step: int | None = None) -> dict:
    """The stored record of a checkpoint (default: the latest), without its arrays.

    Returns:
      A dict with "step", "replica_count", "process_count",
      "local_device_count", "fingerprint", "leaves" and "user" (the metadata
      passed to `save`).

    Raises:
      jdist.errors.CheckpointError: no such checkpoint, or it is unreadable.
    """
    return self._from_rank0(lambda: self._read_record(self._resolve_step(step)),
                            "jdist checkpoint: read metadata")

  # Save -------------------------------------------------------------------

  def _check_new_step(self, step: int) -> None:
    steps = self._local_steps()
    if steps and step <= steps[-1]:
      raise errors.CheckpointError(
          f"Cannot save step {step} in {self.directory}: it already holds step "
          f"{steps[-1]}{' (this very step)' if step in steps else ''}. Steps must grow; "
          f"to restart from an older step, save into a new directory or delete the "
          f"newer step directories first.")

  def save(self, step: int, state: Any, *, metadata: dict | None = None) -> None:
    """Writes a checkpoint of replicated `state` as step `step`.

    Every replica's copy is kept (see the module doc). Rank 0 writes; every
    process returns once the checkpoint is complete (or raises if not).

    Args:
      step: the step number; must be larger than every saved step.
      state: a pytree of replicated arrays (leading local-device axis), e.g.
        {"params": params, "opt_state": opt_state}.
      metadata: a JSON-serializable dict stored alongside (step, epoch,
        batch in epoch, seed, model name, config...). Rank 0's is written.

    Raises:
      jdist.errors.ShapeError: a leaf is not in the replicated layout.
      jdist.errors.StructureMismatchError: processes hold different states.
      jdist.errors.CheckpointError: bad step or metadata, or the write failed.
    """
    try:
      step = operator.index(step)
    except TypeError:
      raise ValueError(f"step={step!r} must be an int.") from None
    if step < 0:
      raise ValueError(f"step={step} must be >= 0.")
    topo = self.topology
    leaves, signature = _signature(state, topo.local_device_count, "CheckpointManager.save")
    if not leaves:
      raise ValueError("CheckpointManager.save: the state has no arrays to save.")
    key_impls = [str(jax.random.key_impl(leaf)) if _is_key(leaf.dtype) else None
                 for leaf in leaves]
    host_leaves = [np.asarray(x) for x in jax.device_get(
        [jax.random.key_data(leaf) if _is_key(leaf.dtype) else leaf for leaf in leaves])]
    ops.check_structure(jax.tree.unflatten(jax.tree.structure(state), host_leaves),
                        "jdist.CheckpointManager.save")
    user, problem = _encode_metadata(metadata)
    if problem is None and topo.is_primary:
      try:
        self._check_new_step(step)
      except errors.CheckpointError as err:
        problem = str(err)
    summaries = [_local_summary(x, digest=topo.multi_process) for x in host_leaves]
    everyone = host.allgather_object((summaries, problem), "jdist checkpoint: save check")
    for rank, (_, rank_problem) in enumerate(everyone):
      if rank_problem is not None:
        raise errors.CheckpointError(f"Checkpoint step {step} not saved (rank {rank}): "
                                     f"{rank_problem}")
    # Stored once if equal on every replica of every process, else per replica.
    per_replica = [None in column or len(set(column)) > 1
                   for column in zip(*(rank_summaries for rank_summaries, _ in everyone))]
    gathered = _gather_to_rank0(host_leaves, [i for i, p in enumerate(per_replica) if p], topo)

    failure = None
    if topo.is_primary:
      record = {
          "format": FORMAT, "version": FORMAT_VERSION, "step": step,
          "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
          "replica_count": topo.replica_count, "process_count": topo.process_count,
          "local_device_count": topo.local_device_count,
          "fingerprint": fingerprint(signature),
          "leaves": [{"path": path, "shape": shape, "dtype": dtype,
                      "per_replica": per_replica[i], "key_impl": key_impls[i],
                      "stored_shape": list(host_leaves[i].shape[1:]),
                      "stored_dtype": str(host_leaves[i].dtype)}
                     for i, (path, shape, dtype) in enumerate(signature)],
          "user": user,
      }
      # orbax cannot store zero-size arrays; the record alone describes them.
      arrays = {_leaf_name(i): gathered[i] if per_replica[i] else x[:1]
                for i, x in enumerate(host_leaves) if x.size}
      try:
        self._write(step, arrays, record)
      except Exception as err:  # pylint: disable=broad-except
        failure = f"{type(err).__name__}: {err}"
    # Doubles as the barrier after the write: nobody runs ahead of rank 0.
    failure = host.allgather_object(failure, "jdist checkpoint: rank 0 writes")[0]
    if failure is not None:
      raise errors.CheckpointError(
          f"Rank 0 could not write checkpoint step {step} to {self.directory}: {failure}")

  def _write(self, step: int, arrays: dict, record: dict) -> None:
    self.directory.mkdir(parents=True, exist_ok=True)
    items = {_RECORD: ocp.args.JsonSave(record)}
    if arrays:
      items[_ARRAYS] = ocp.args.PyTreeSave(arrays)
    self._checkpointer.save(self.directory / str(step), args=ocp.args.Composite(**items))
    steps = self._local_steps()
    for old in steps[:-self.keep] if self.keep else []:
      (self.directory / str(old)).rmtree()
    # Only rank 0 writes, one save at a time: any temporary directory left is
    # a killed writer's, never one being written.
    for leftover in self.directory.glob(f"*{ocp.path.atomicity.TMP_DIR_SUFFIX}*"):
      log.info("Removing unfinished checkpoint %s (a writer was interrupted).", leftover)
      leftover.rmtree()

  # Restore ----------------------------------------------------------------

  def restore(self, state_template: Any, step: int | None = None) -> tuple[Any, dict]:
    """Reads a checkpoint (default: the latest) into the replicated layout.

    Args:
      state_template: a pytree like the saved state, in the replicated layout
        of this run (arrays or `jax.ShapeDtypeStruct`s, e.g. the freshly
        initialized state); only its structure, shapes and dtypes are used.
      step: which checkpoint; default the latest complete one.

    Returns:
      (state, metadata): the state with every local replica's own copy, laid
      out as `jdist.replicate` lays it out, and the metadata given to `save`.

    Raises:
      jdist.errors.CheckpointError: no such checkpoint, a corrupt one, one of
        another model (naming the first differing leaf), or per-replica state
        written by another number of replicas.
    """
    topo = self.topology
    _, signature = _signature(state_template, topo.local_device_count,
                              "CheckpointManager.restore")
    wanted = step
    step = self._from_rank0(lambda: self._resolve_step(wanted), "jdist checkpoint: find step")
    path = self.directory / str(step)
    state, problem = None, None
    try:
      record = self._read_record(step)
      _check_fingerprint(path, record, signature)
      _check_world(path, record, topo)
      devices = jax.local_devices()[:topo.local_device_count]
      state = [_put_local(stacked, devices, leaf["key_impl"])
               for stacked, leaf in zip(self._read_local(path, record), record["leaves"])]
    except errors.CheckpointError as err:
      problem = str(err)
    except Exception as err:  # pylint: disable=broad-except
      problem = f"{path} could not be read ({type(err).__name__}: {err})."
    # Everyone learns whether everyone succeeded: a rank that cannot read the
    # files must not leave the others running into the next collective alone.
    problems = host.allgather_object(problem, "jdist checkpoint: restore")
    for rank, rank_problem in enumerate(problems):
      if rank_problem is not None and rank_problem == problem:
        raise errors.CheckpointError(problem)
      if rank_problem is not None:
        raise errors.CheckpointError(
            f"Rank {rank} could not restore: {rank_problem} (the checkpoint directory "
            f"must be on a filesystem every process reads).")
    if topo.is_primary and record["replica_count"] != topo.replica_count:
      log.warning("Restored %s, written by %d replicas (%d x %d), into %d replicas (%s): "
                  "every leaf was equal on all replicas, so replica 0's copy was taken.",
                  path, record["replica_count"], record["process_count"],
                  record["local_device_count"], topo.replica_count, topo)
    return jax.tree.unflatten(jax.tree.structure(state_template), state), record["user"]

  def _read_local(self, path, record: dict) -> list[np.ndarray]:
    """This process's replicas of every leaf, as [local_devices, ...] host arrays."""
    topo = self.topology
    saved_replicas = record["replica_count"]
    names = {_leaf_name(i): leaf for i, leaf in enumerate(record["leaves"])
             if int(np.prod(leaf["stored_shape"], dtype=np.int64)) > 0}
    arrays = {}
    if names:
      target = {name: jax.ShapeDtypeStruct(
          (saved_replicas if leaf["per_replica"] else 1,) + tuple(leaf["stored_shape"]),
          jnp.dtype(leaf["stored_dtype"])) for name, leaf in names.items()}
      restore_args = {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in names}
      arrays = self._checkpointer.restore(path, args=ocp.args.Composite(**{
          _ARRAYS: ocp.args.PyTreeRestore(target, restore_args=restore_args)}))[_ARRAYS]
    local = []
    for i, leaf in enumerate(record["leaves"]):
      shape = tuple(leaf["stored_shape"])
      stored = arrays.get(_leaf_name(i))
      if stored is None:  # zero-size leaf: nothing was written
        stored = np.zeros((1,) + shape, jnp.dtype(leaf["stored_dtype"]))
      if stored.shape[1:] != shape:
        raise errors.CheckpointError(f"{path}: {leaf['path']} is stored with shape "
                                     f"{stored.shape}, its record says {shape}; corrupt.")
      if leaf["per_replica"]:  # _check_world made sure the replica counts agree
        local.append(stored[list(topo.replica_indices)])
      else:
        local.append(np.broadcast_to(stored[:1], (topo.local_device_count,) + shape))
    return local


def _check_fingerprint(path, record: dict, signature: list) -> None:
  """Raises CheckpointError naming the first leaf where the template differs."""
  if record["fingerprint"] == fingerprint(signature):
    return
  stored = [[leaf["path"], leaf["shape"], leaf["dtype"]] for leaf in record["leaves"]]
  first = next(i for i in range(max(len(stored), len(signature)))
               if i >= len(stored) or i >= len(signature) or stored[i] != signature[i])

  def show(leaves):
    if first >= len(leaves):
      return "no leaf"
    leaf_path, shape, dtype = leaves[first]
    return f"{leaf_path} shape={tuple(shape)} dtype={dtype}"

  user = record.get("user")
  model = user.get("model") if isinstance(user, dict) else None
  raise errors.CheckpointError(
      f"{path} holds a different state (model {model!r}): first difference at leaf "
      f"#{first}: the checkpoint has {show(stored)}, the template has {show(signature)}. "
      f"Restore with a template built from the same model and optimizer as the checkpoint.")


def _check_world(path, record: dict, topo) -> None:
  """Raises CheckpointError if per-replica state meets another replica count."""
  saved = record["replica_count"]
  per_replica = [leaf["path"] for leaf in record["leaves"] if leaf["per_replica"]]
  if saved == topo.replica_count or not per_replica:
    return
  raise errors.CheckpointError(
      f"{path} was written by {saved} replicas ({record['process_count']} processes x "
      f"{record['local_device_count']} devices) and {len(per_replica)} of its leaves "
      f"differ per replica (first: {per_replica[0]}): error-feedback residuals "
      f"(jdist.topk / jdist.threshold) or local parameters (jdist.partial_sync) cannot be "
      f"split over this run's {topo.replica_count} replicas. Resume with {saved} "
      f"replicas; or, in a run with {saved} replicas, restore it, average the parameters "
      f"with jdist.sync_params and save them with a fresh plain optimizer state "
      f"(jdist.dist_opt without sparsify/partial), which any number of replicas restores.")
