"""The chaos run's and its replay's checkpoints: kept as they appear, compared step by step.

`Archive` copies every complete checkpoint as it appears (the runs keep only the newest
few); `compare` finds the first step where the two differ by more than the tolerance
and `segment_of` the run that trained up to it. Both tiers are read without a jdist world.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import threading

import numpy as np

_LOCAL_RECORD, _LOCAL_ARRAYS = "record.json", "arrays.npz"
_PERSISTENT_RECORD = os.path.join("jdist", "metadata")  # orbax's JSON item


def local_dirs(checkpoint_dir: str) -> str:
  """A glob of every node's default local-tier directory for `checkpoint_dir`.

  As `jdist.app.checkpoint_tiers.default_local_dir` names them (under /dev/shm),
  for every host name.
  """
  digest = hashlib.sha1(os.path.abspath(checkpoint_dir).encode()).hexdigest()[:12]
  return os.path.join("/dev/shm", "jdist-local", f"*-{digest}")


def _record_file(path: str) -> str:
  local = os.path.join(path, _LOCAL_RECORD)
  return local if os.path.exists(local) else os.path.join(path, _PERSISTENT_RECORD)


def complete(path: str) -> bool:
  """Whether `path` holds a whole checkpoint of either tier (a copy may catch one mid-delete)."""
  local = (_LOCAL_RECORD, _LOCAL_ARRAYS)
  persistent = (_PERSISTENT_RECORD, os.path.join("state", "_METADATA"))
  return any(all(os.path.exists(os.path.join(path, part)) for part in parts)
             for parts in (local, persistent))


def _steps(directory: str) -> list[str]:
  try:
    return [name for name in os.listdir(directory) if name.isdigit()]
  except OSError:
    return []


class Archive:
  """Copies every complete checkpoint of `sources` ({label: directory or glob}) as it appears.

  A copy is `<root>/<label>/<step>-<n>`, n counting the copies made: the higher n, the
  newer save of a step saved again.
  """

  def __init__(self, root: str, sources: dict[str, str], interval: float = 0.2):
    self.root, self.sources, self.interval = root, dict(sources), interval
    self.seen: dict[tuple, str] = {}
    self.count = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def start(self) -> "Archive":
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()
    self.scan()  # whatever appeared since the last look

  def _loop(self) -> None:
    while not self._stop.wait(self.interval):
      self.scan()

  def scan(self) -> None:
    """Copies the complete checkpoints not copied yet."""
    for label, pattern in self.sources.items():
      for directory in sorted(glob.glob(pattern)):
        for name in _steps(directory):
          path = os.path.join(directory, name)
          try:  # the record: written once per save, with its time to the microsecond (an
            with open(_record_file(path), "rb") as stream:  # inode and mtime can both repeat
              record = hashlib.sha1(stream.read()).hexdigest()  # when a save follows a delete)
          except OSError:
            continue  # not complete yet, or gone
          key = (label, path, record)
          if key in self.seen:
            continue
          target = os.path.join(self.root, label, f"{name}-{self.count}")
          try:
            shutil.copytree(path, target)
          except (OSError, shutil.Error):
            pass
          if not complete(target):  # deleted while copied: gone
            shutil.rmtree(target, ignore_errors=True)
            continue
          self.seen[key] = target
          self.count += 1

  def copies(self, *labels: str) -> dict[int, list[str]]:
    """{step: [copy, ...]} of these labels together, oldest save first."""
    found: dict[int, list[tuple[int, str]]] = {}
    for label in labels:
      directory = os.path.join(self.root, label)
      for name in os.listdir(directory) if os.path.isdir(directory) else []:
        step, number = (int(part) for part in name.split("-"))
        found.setdefault(step, []).append((number, os.path.join(directory, name)))
    return {step: [path for _, path in sorted(paths)] for step, paths in sorted(found.items())}


def read_checkpoint(path: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(record, {leaf path: first stored copy}) of a persistent or local checkpoint."""
  if os.path.exists(os.path.join(path, _LOCAL_RECORD)):
    with open(os.path.join(path, _LOCAL_RECORD), encoding="utf-8") as stream:
      record = json.load(stream)
    with np.load(os.path.join(path, _LOCAL_ARRAYS)) as stored:
      raw = {name: stored[name] for name in stored.files}
    arrays = {}
    for i, leaf in enumerate(record["leaves"]):
      name = f"leaf_{i:05d}"
      if name in raw:
        arrays[name] = raw[name].view(np.dtype(leaf["stored_dtype"])).reshape(
            (-1,) + tuple(leaf["stored_shape"]))
  else:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    with open(os.path.join(path, _PERSISTENT_RECORD), encoding="utf-8") as stream:
      record = json.load(stream)
    arrays = ocp.PyTreeCheckpointer().restore(os.path.join(path, "state"))
  named = {}
  for i, leaf in enumerate(record["leaves"]):
    name = f"leaf_{i:05d}"
    if name in arrays:
      named[str(leaf["path"])] = np.asarray(arrays[name])[0]
  return record, named


def difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, str | None]:
  """The largest absolute difference over the leaves both hold, and its leaf."""
  worst, where = 0.0, None
  for name in sorted(set(a) & set(b)):
    x, y = np.asarray(a[name], np.float64), np.asarray(b[name], np.float64)
    if x.shape != y.shape:
      return float("inf"), name
    if x.size:
      gap = float(np.max(np.abs(x - y)))
      if gap > worst or where is None:
        worst, where = gap, name
  return worst, where


def segment_of(schedule: list[tuple[int, int, int | None]], step: int) -> int | None:
  """The index of the segment (from, processes, to) that trained up to `step`."""
  for index, (start, _, end) in enumerate(schedule):
    if start < step and (end is None or step <= end):
      return index
  return None


def compare(chaos: dict[int, list[str]], replay: dict[int, list[str]],
            schedule: list[tuple[int, int, int | None]], tolerance: float,
            read=read_checkpoint) -> dict:
  """Lines up the chaos run's checkpoints with the replay's, step by step.

  A step's newest save on each side is the one on the trajectory that went
  on (an older one was saved by a run whose successor resumed from before
  it); the older chaos saves are compared too, and reported apart.

  Returns:
    {"steps": [[step, max abs difference], ...], "first_over": the first step
    over `tolerance` with its leaf, position and segment (or None),
    "superseded": [[step, difference], ...] of the older chaos saves,
    "unreadable": copies that could not be read}.
  """
  rows, superseded, unreadable, first = [], [], [], None
  cache: dict[str, tuple[dict, dict] | None] = {}

  def load(path):
    if path not in cache:
      try:
        cache[path] = read(path)
      except Exception:  # pylint: disable=broad-except
        cache[path] = None  # a copy caught mid-delete
        unreadable.append(path)
    return cache[path]

  for step in sorted(set(chaos) & set(replay)):
    theirs = next((c for c in map(load, reversed(replay[step])) if c is not None), None)
    paths = [(path, load(path)) for path in chaos[step]]
    paths = [(path, c) for path, c in paths if c is not None]
    if theirs is None or not paths:
      continue
    for path, (record, mine) in paths[:-1]:
      superseded.append([step, difference(mine, theirs[1])[0]])
    path, (record, mine) = paths[-1]
    gap, leaf = difference(mine, theirs[1])
    rows.append([step, gap])
    if first is None and gap > tolerance:
      index = segment_of(schedule, step)
      user, theirs_user = record.get("user") or {}, theirs[0].get("user") or {}
      first = {"step": step, "max_abs": gap, "leaf": leaf, "copy": path,
               "position": [user.get("epoch"), user.get("batch_in_epoch")],
               "replay_position": [theirs_user.get("epoch"), theirs_user.get("batch_in_epoch")],
               "written_by_replicas": [record.get("replica_count"),
                                       theirs[0].get("replica_count")],
               "segment": index,
               "segment_details": list(schedule[index]) if index is not None else None}
  return {"steps": rows, "first_over": first, "superseded": superseded,
          "unreadable": unreadable}
