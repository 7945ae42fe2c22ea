"""How a jdist checkpoint lays out replicated state: stored arrays and record.

`jdist.checkpoint.CheckpointManager` runs the collective save/restore flow
and talks to orbax; this module holds what it stores and how replicas map to
it, with no file I/O of its own:

  * the two styles a state comes in (`detect_style`): the *replicated*
    layout of the data_parallel style (a leading axis of one copy per local
    device, as `jdist.replicate` lays it out) and the *global* arrays of the
    jit style (over `jdist.mesh()`, one copy per process; NNX's
    `nnx.state(model)` of a jit-style model), and each process's host copies
    of them (`host_copies`);
  * the state's signature (paths, per-copy shapes, dtypes) and its
    `fingerprint` (`state_signature`);
  * which leaves differ per replica (`local_summary`), and the gather of
    those to rank 0 (`gather_to_rank0`);
  * the JSON record stored beside the arrays (`build_record`,
    `check_format`) and the user's metadata in it (`encode_metadata`);
  * the checks a restore makes against a record (`check_fingerprint`,
    `check_world`), and the layout it puts the arrays back in (`put_local`,
    `put_global`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
from typing import Any

import jax
import numpy as np

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from jdist.data import batches
from jdist import errors
from jdist.collectives import context
from jdist.runtime import host

FORMAT = "jdist-checkpoint"
FORMAT_VERSION = 2  # 2: the record names its style and its copies (1: replicated only)
REPLICATED = "replicated"  # data_parallel: a leading axis of one copy per local device
GLOBAL = "global"          # jit: arrays over jdist.mesh(), one copy per process
STYLES = (REPLICATED, GLOBAL)
_STYLE_NAMES = {
    REPLICATED: "the replicated layout of the data_parallel style (a leading axis of one "
                "copy per local device, as jdist.replicate lays it out)",
    GLOBAL: "a global array of the jit style (over jdist.mesh(), one copy per process, "
            "e.g. nnx.state(model) of a jit-style NNX model)",
}
GATHER_BYTES = 64 << 20  # per-process payload of one gather to rank 0


def leaf_name(index: int) -> str:
  """The name leaf `index` of the flattened state is stored under."""
  return f"leaf_{index:05d}"


def is_key(dtype) -> bool:
  """Whether `dtype` is a typed PRNG key (stored as its key data)."""
  return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _leaf_style(leaf, devices: int) -> str | None:
  """The style a leaf's placement shows, or None where it could be either."""
  shape = tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)
  if not shape or shape[0] != devices:
    return GLOBAL
  sharding = getattr(leaf, "sharding", None)
  if sharding is None or 0 in shape:  # host arrays, shape-only templates; XLA calls
    return None                       # zero-size arrays replicated
  if isinstance(sharding, NamedSharding) and sharding.spec:
    first = sharding.spec[0]
    if first == context.DATA_AXIS or (isinstance(first, tuple) and context.DATA_AXIS in first):
      return REPLICATED
  # On one device XLA may spell the replicated layout's (1, ...) as replicated.
  return None if devices == 1 else GLOBAL


def detect_style(tree: Any, devices: int, what: str, style: str | None = None) -> str:
  """The style of a state: `style` if given, else what its leaves' placement shows.

  A leaf sharded one row per local device over `jdist.DATA_AXIS` (what
  `jdist.replicate` and `jdist.data_parallel` return) is replicated; any
  other device array (with one local device, any other leaf), and any leaf
  that cannot carry the device axis (scalars, another leading size), is
  global. Host arrays whose leading size is the local device count could be
  either: a state of only those is taken as replicated (pass style="global"
  otherwise).

  Raises:
    ValueError: an unknown `style`.
    jdist.errors.ShapeError: leaves of both styles in one state.
  """
  if style is not None:
    if style not in STYLES:
      raise ValueError(f"{what}: style={style!r} must be {REPLICATED!r} (data_parallel "
                       f"style), {GLOBAL!r} (jit style) or None (from the state).")
    return style
  first = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    found = _leaf_style(leaf, devices)
    if found is not None:
      first.setdefault(found, jax.tree_util.keystr(path))
  if len(first) == 2:
    raise errors.ShapeError(
        f"{what}: the state mixes the two styles: leaf {first[REPLICATED]} is in "
        f"{_STYLE_NAMES[REPLICATED]}, leaf {first[GLOBAL]} is {_STYLE_NAMES[GLOBAL]}. "
        f"Save and restore one style's state (jdist.replicate / jdist.unreplicate convert), "
        f"or name it with style='replicated' or style='global'.")
  return next(iter(first), REPLICATED)


def state_signature(tree: Any, devices: int, what: str,
                    style: str = REPLICATED) -> tuple[list, list]:
  """(leaves, [[path, per-copy shape, dtype], ...]) of a state in `style`.

  Args:
    tree: a pytree; in the replicated style its leaves have a leading axis of
      `devices`, which the signature leaves out.
    devices: this process's local device count.
    what: the caller, named in the error.
    style: REPLICATED or GLOBAL.

  Raises:
    jdist.errors.ShapeError: a leaf is not in the replicated layout.
  """
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  signature = []
  for path, leaf in with_paths:
    shape = tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)
    if style == REPLICATED:
      problem = batches.leading_axis_error(
          f"{what}: leaf {jax.tree_util.keystr(path)}", shape, devices,
          f"the state was taken as {_STYLE_NAMES[REPLICATED]}, which has a leading axis of "
          f"{devices}. Pass the state your data_parallel step uses (jdist.replicate(...) of "
          f"it), or style='global' for a jit-style state over jdist.mesh().")
      if problem is not None:
        raise problem
      shape = shape[1:]
    signature.append([jax.tree_util.keystr(path), list(shape), str(leaf.dtype)])
  return [leaf for _, leaf in with_paths], signature


def _process_copy(leaf) -> np.ndarray:
  """This process's copy of a global array, on the host.

  An array over this process's devices (`jdist.mesh()` under MPI) is read
  whole. One that spans processes (backend "jax") is read from a local shard
  when replicated, else gathered from every process (collective).
  """
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    if leaf.is_fully_replicated:
      return np.asarray(leaf.addressable_data(0))
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
  return np.asarray(jax.device_get(leaf))


def host_copies(leaves: list, style: str) -> tuple[list, list]:
  """(key implementations, host arrays [copies here, ...]): the local devices'
  copies (replicated style) or the process's one copy (global); keys as key data."""
  key_impls = [str(jax.random.key_impl(leaf)) if is_key(leaf.dtype) else None
               for leaf in leaves]
  data = [jax.random.key_data(leaf) if is_key(leaf.dtype) else leaf for leaf in leaves]
  if style == REPLICATED:
    return key_impls, [np.asarray(x) for x in jax.device_get(data)]
  return key_impls, [_process_copy(x)[None] for x in data]


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


def put_global(value: np.ndarray, template, key_impl: str | None) -> jax.Array:
  """A host value as a global array: sharded as `template` where that is a
  NamedSharding, else replicated over `jdist.mesh()` (a fresh model's arrays
  sit on one device, and a jit step over the mesh takes them from there)."""
  sharding = getattr(template, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    sharding = NamedSharding(context.mesh(), PartitionSpec())
  array = jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
  return array if key_impl is None else jax.random.wrap_key_data(array, impl=key_impl)


def copies_of(style: str, topo) -> int:
  """How many copies of a state a job holds in `style`: replicas, or processes."""
  return topo.replica_count if style == REPLICATED else topo.process_count


def local_copies(path, record: dict, arrays: dict, topo, style: str) -> list[np.ndarray]:
  """This process's copies of every leaf, as [copies here, ...] host arrays.

  `arrays` holds the stored arrays by `leaf_name` (zero-size leaves absent);
  the copies are the local replicas' (REPLICATED) or the process's (GLOBAL).
  """
  mine, count = ((list(topo.replica_indices), topo.local_device_count)
                 if style == REPLICATED else ([topo.process_index], 1))
  local = []
  for i, leaf in enumerate(record["leaves"]):
    shape = tuple(leaf["stored_shape"])
    stored = arrays.get(leaf_name(i))
    if stored is None:  # zero-size leaf: nothing was written
      stored = np.zeros((1,) + shape, np.dtype(leaf["stored_dtype"]))
    if stored.shape[1:] != shape:
      raise errors.CheckpointCorruptError(f"{path}: {leaf['path']} is stored with shape "
                                          f"{stored.shape}, its record says {shape}; corrupt.")
    if leaf["per_replica"]:  # check_world made sure the copies agree
      local.append(stored[mine])
    else:
      local.append(np.broadcast_to(stored[:1], (count,) + shape))
  return local


def restore_note(path, record: dict, topo, style: str) -> str | None:
  """What a restore into another style or copy count took, or None if nothing."""
  saved_style, copies = saved_copies(record)
  if saved_style == style == REPLICATED and copies != topo.replica_count:
    return (f"Restored {path}, written by {copies} replicas ({record['process_count']} x "
            f"{record['local_device_count']}), into {topo.replica_count} replicas ({topo}): "
            f"every leaf was equal on all replicas, so replica 0's copy was taken.")
  if (saved_style, copies) != (style, copies_of(style, topo)):
    return (f"Restored {path}, written in the {saved_style} style by "
            f"{record['process_count']} x {record['local_device_count']}, into the {style} "
            f"style ({topo}): every leaf was equal on all copies, so the first copy was taken.")
  return None


def build_record(step: int, topo, signature: list, per_replica: list[bool],
                 key_impls: list, host_leaves: list, user: dict,
                 style: str = REPLICATED) -> dict:
  """The JSON record of a checkpoint: the world that wrote it, its leaves, `user`.

  Args:
    step: the checkpoint's step.
    topo: the writing job's topology.
    signature: the state's signature (see `state_signature`).
    per_replica: per leaf, whether it is stored per replica (else once).
    key_impls: per leaf, its PRNG key implementation, or None if no key.
    host_leaves: the leaves as stored (key data for keys), [local copies, ...].
    user: the user's metadata, as `encode_metadata` returns it.
    style: REPLICATED (copies: the replicas) or GLOBAL (copies: the processes).
  """
  return {
      "format": FORMAT, "version": FORMAT_VERSION, "step": step,
      "style": style, "copies": copies_of(style, topo),
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


def saved_copies(record: dict) -> tuple[str, int]:
  """(style, copies) of a record (version 1 records are replicated)."""
  return record.get("style", REPLICATED), record.get("copies", record["replica_count"])


def check_world(path, record: dict, topo, style: str = REPLICATED) -> None:
  """Raises CheckpointError if per-copy state meets another style or copy count."""
  saved_style, saved = saved_copies(record)
  per_replica = [leaf["path"] for leaf in record["leaves"] if leaf["per_replica"]]
  if (saved_style, saved) == (style, copies_of(style, topo)) or not per_replica:
    return
  if (saved_style, style) != (REPLICATED, REPLICATED):
    unit = {REPLICATED: "replicas", GLOBAL: "processes"}
    raise errors.CheckpointError(
        f"{path} was written in the {saved_style} style by {saved} {unit[saved_style]} "
        f"({record['process_count']} processes x {record['local_device_count']} devices) "
        f"and {len(per_replica)} of its leaves differ per copy (first: {per_replica[0]}): "
        f"they cannot be split over this run's {copies_of(style, topo)} {unit[style]} in "
        f"the {style} style. Resume in the {saved_style} style with {saved} "
        f"{unit[saved_style]}; or there, average the parameters (jdist.sync_params, or "
        f"jdist.pmean in a jit step) and save them with a fresh plain optimizer state "
        f"(jdist.dist_opt without sparsify/partial), which any style and count restores.")
  raise errors.CheckpointError(
      f"{path} was written by {saved} replicas ({record['process_count']} processes x "
      f"{record['local_device_count']} devices) and {len(per_replica)} of its leaves "
      f"differ per replica (first: {per_replica[0]}): error-feedback residuals "
      f"(jdist.topk / jdist.threshold) or local parameters (jdist.partial_sync) cannot be "
      f"split over this run's {topo.replica_count} replicas. Resume with {saved} "
      f"replicas; or, in a run with {saved} replicas, restore it, average the parameters "
      f"with jdist.sync_params and save them with a fresh plain optimizer state "
      f"(jdist.dist_opt without sparsify/partial), which any number of replicas restores.")
