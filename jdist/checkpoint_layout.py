"""How a jdist checkpoint lays out replicated state: stored arrays and record.

`jdist.checkpoint.CheckpointManager` runs the collective save/restore flow
and talks to orbax; this module holds what it stores and how replicas map to
it, with no file I/O of its own:

  * the state's signature (paths, per-replica shapes, dtypes) and its
    `fingerprint` (`state_signature`);
  * which leaves differ per replica (`local_summary`), and the gather of
    those to rank 0 (`gather_to_rank0`);
  * the JSON record stored beside the arrays (`build_record`,
    `check_format`) and the user's metadata in it (`encode_metadata`);
  * the checks a restore makes against a record (`check_fingerprint`,
    `check_world`), and the replicated layout it puts the arrays back in
    (`put_local`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
from typing import Any

import jax
import numpy as np

from jdist import batches
from jdist import errors
from jdist.collectives import context
from jdist.runtime import host

FORMAT = "jdist-checkpoint"
FORMAT_VERSION = 1
GATHER_BYTES = 64 << 20  # per-process payload of one gather to rank 0


def leaf_name(index: int) -> str:
  """The name leaf `index` of the flattened state is stored under."""
  return f"leaf_{index:05d}"


def is_key(dtype) -> bool:
  """Whether `dtype` is a typed PRNG key (stored as its key data)."""
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def state_signature(tree: Any, devices: int, what: str) -> tuple[list, list]:
  """(leaves, [[path, per-replica shape, dtype], ...]) of a replicated tree.

  Args:
    tree: a pytree whose leaves have a leading axis of `devices`.
    devices: this process's local device count.
    what: the caller, named in the error.

  Raises:
    jdist.errors.ShapeError: a leaf is not in the replicated layout.
  """
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  signature = []
  for path, leaf in with_paths:
    shape = tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)
    problem = batches.leading_axis_error(
        f"{what}: leaf {jax.tree_util.keystr(path)}", shape, devices,
        f"a replicated state has a leading axis of {devices} (one copy per local device). "
        f"Pass the state your data_parallel step uses (jdist.replicate(...) of it).")
    if problem is not None:
      raise problem
    signature.append([jax.tree_util.keystr(path), list(shape[1:]), str(leaf.dtype)])
  return [leaf for _, leaf in with_paths], signature


def fingerprint(signature: list) -> str:
  """A digest of a state's structure, shapes and dtypes."""
  return hashlib.sha256(json.dumps(signature).encode()).hexdigest()


def _json_default(value):
  if isinstance(value, (np.generic, np.ndarray, jax.Array)):
    return np.asarray(value).tolist()
  raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_metadata(metadata: Any) -> tuple[dict | None, str | None]:
  """(the user's metadata as plain JSON, None), or (None, what is wrong with it)."""
  if metadata is None:
    return {}, None
  if not isinstance(metadata, dict):
    return None, f"metadata must be a dict, got {type(metadata).__name__}"
  try:
    return json.loads(json.dumps(metadata, default=_json_default)), None
  except (TypeError, ValueError) as err:
    return None, (f"metadata must be JSON-serializable (numbers, strings, lists, "
                  f"dicts; numpy scalars are converted): {err}")


def local_summary(array: np.ndarray, digest: bool) -> str | None:
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


def gather_to_rank0(host_leaves: list, ids: list[int], topo) -> dict[int, np.ndarray]:
  """Every process's [local_devices, ...] copy of leaves `ids`, as [replicas, ...] on rank 0.

  Leaves travel as flat segments, at most `GATHER_BYTES` per process and
  exchange, so no message grows with the model. (`allgather_object` hands
  every process every payload; a gather to rank 0 alone would halve the
  traffic, but this runs once per checkpoint.)
  """
  if topo.process_count == 1:
    return {i: host_leaves[i] for i in ids}
  segments = []  # (leaf id, start, stop) in elements of the flattened leaf
  for i in ids:
    count = max(1, GATHER_BYTES // host_leaves[i].itemsize)
    segments += [(i, start, min(start + count, host_leaves[i].size))
                 for start in range(0, host_leaves[i].size, count)]
  pieces = {i: [[] for _ in range(topo.process_count)] for i in ids}
  bucket, size = [], 0
  for index, (i, start, stop) in enumerate(segments):
    bucket.append((i, start, stop))
    size += (stop - start) * host_leaves[i].itemsize
    if size < GATHER_BYTES and index + 1 < len(segments):
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


def put_local(stacked: np.ndarray, devices: list, key_impl: str | None) -> jax.Array:
  """[devices, ...] host array → one slice per local device, as jdist.replicate lays it out."""
  sharding = context.per_device_sharding(devices)
  pieces = [jax.device_put(stacked[d:d + 1], device) for d, device in enumerate(devices)]
  array = jax.make_array_from_single_device_arrays(stacked.shape, sharding, pieces)
  return array if key_impl is None else jax.random.wrap_key_data(array, impl=key_impl)


def build_record(step: int, topo, signature: list, per_replica: list[bool],
                 key_impls: list, host_leaves: list, user: dict) -> dict:
  """The JSON record of a checkpoint: the world that wrote it, its leaves, `user`.

  Args:
    step: the checkpoint's step.
    topo: the writing job's topology.
    signature: the state's signature (see `state_signature`).
    per_replica: per leaf, whether it is stored per replica (else once).
    key_impls: per leaf, its PRNG key implementation, or None if no key.
    host_leaves: the leaves as stored (key data for keys), [local_devices, ...].
    user: the user's metadata, as `encode_metadata` returns it.
  """
  return {
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


def check_format(path, record: Any) -> None:
  """Raises CheckpointError unless `record` is a jdist record this jdist reads."""
  if not isinstance(record, dict) or record.get("format") != FORMAT:
    raise errors.CheckpointError(f"{path} was not written by jdist.CheckpointManager.")
  if record.get("version", 0) > FORMAT_VERSION:
    raise errors.CheckpointError(
        f"{path} has checkpoint format version {record['version']}; this jdist reads up "
        f"to {FORMAT_VERSION}. Upgrade jdist.")


def check_fingerprint(path, record: dict, signature: list) -> None:
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


def check_world(path, record: dict, topo) -> None:
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
