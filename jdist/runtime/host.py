"""Host-side exchanges across processes, outside compiled steps.

These run in plain Python between steps (broadcasting initial parameters,
reducing metrics computed on the host, barriers). Each is a no-op in a
single-process run and runs under the watchdog's deadline otherwise.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdist import fusion
from jdist.runtime import job as job_lib
from jdist.runtime import start_check
from jdist.runtime import topology as topology_lib


def _world():
  """The MPI world of a job of several processes, else None.

  Under an MPI launcher before `jdist.init()`, raises (see
  `jdist.runtime.job.current`) rather than exchanging nothing.
  """
  world = job_lib.world()
  if world is None and topology_lib.launched_by_mpi():
    job_lib.current()  # before jdist.init(): raises, naming it
  return world if world is not None and world.size > 1 else None


def is_multiprocess() -> bool:
  """True when this process exchanges with others over MPI."""
  world = job_lib.world()
  return world is not None and world.size > 1


def abort(code: int = 1) -> None:
  """Ends the whole MPI job (the other ranks may be waiting for this one).

  A no-op outside a job of several MPI processes.
  """
  world = job_lib.world()
  if world is not None and world.size > 1:
    world.abort(code)


def mpi_description() -> str | None:
  """The MPI library and its thread level, once MPI is started; else None."""
  world = job_lib.world()
  if world is None:
    return None
  library = world.MPI.Get_library_version().strip().splitlines()[0]
  return f"{library} (thread multiple: {world.thread_multiple})"


def _per_bucket(tree: Any, exchange) -> Any:
  """Applies a numpy buffer exchange to `tree`, one call per dtype bucket."""
  leaves, treedef = jax.tree.flatten(tree)
  host = [np.asarray(leaf) for leaf in leaves]
  shapes = [leaf.shape for leaf in host]
  out: dict[int, Any] = {}
  for bucket in fusion.plan_buckets(host):
    buffer = np.concatenate([host[i].reshape(-1) for i in bucket.leaf_ids])
    out.update(fusion.unpack(exchange(buffer), bucket, shapes))
  return jax.tree.unflatten(treedef, [out[i] for i in range(len(host))])


def broadcast_params(tree: Any, root: int = 0) -> Any:
  """Every process gets process `root`'s values of `tree` (identical start).

  Call it on the host after initializing parameters (which may differ per
  process, e.g. seeded by rank), before replicating them to local devices.

  Args:
    tree: a pytree of arrays (not replicated: no leading device axis).
    root: the process whose values everyone takes.

  Returns:
    The same structure, leaves as jax arrays holding root's values.

  Raises:
    ValueError: root is not a valid process index.
    StructureMismatchError: processes hold differently shaped trees.
  """
  world = _world()
  size = world.size if world else 1
  if not 0 <= root < size:
    raise ValueError(f"root={root} is not a process index: there are {size} processes.")
  if world is None:
    return jax.tree.map(jnp.asarray, tree)
  job_lib.check_structure(tree, "jdist.broadcast_params")
  out = _per_bucket(tree, lambda b: world.bcast_array(b, root, "jdist.broadcast_params"))
  start_check.params_broadcast()  # an identical start after all
  return jax.tree.map(jnp.asarray, out)


def host_allreduce(tree: Any, *, mean: bool = False) -> Any:
  """Sum (or mean) over processes of host values, e.g. metrics.

  Note: this reduces over processes, not devices: reduce per-device values
  inside the step with `jdist.psum` instead.
  """
  world = _world()
  if world is None:
    return jax.tree.map(np.asarray, tree)
  job_lib.check_structure(jax.tree.map(np.asarray, tree), "jdist.host_allreduce")
  out = _per_bucket(tree, lambda b: world.allreduce_array(b, "jdist.host_allreduce"))
  return jax.tree.map(lambda x: x / world.size if mean else x, out)


def barrier(label: str = "jdist.barrier") -> None:
  """Waits until every process arrives (under the watchdog's deadline)."""
  world = _world()
  if world is not None:
    world.barrier(label)


def allgather_object(obj: Any, label: str = "jdist.allgather_object") -> list[Any]:
  """Every process's picklable `obj`, in rank order (host side)."""
  world = _world()
  return [obj] if world is None else world.allgather_object(obj, label)


def agree(problem: Any, label: str, error, *, payload: Any = None) -> list[Any]:
  """Makes every process fail alike when any one fails (host side, collective).

  Every process says what went wrong on it (None: nothing). All hear it, so
  a process whose part failed never leaves the others to run into the next
  exchange alone, and every process raises the same kind of error.

  Args:
    problem: this process's problem, picklable; None when its part went well.
    label: names the exchange in watchdog reports.
    error: `error(rank, problems)` builds the exception to raise, from the
      lowest failing rank and every rank's problem (in rank order).
    payload: a picklable value shared along with the problem.

  Returns:
    Every process's payload, in rank order, when no process has a problem.

  Raises:
    Exception: the one `error` builds, on every process.
  """
  gathered = allgather_object((problem, payload), label)
  problems = [rank_problem for rank_problem, _ in gathered]
  for rank, rank_problem in enumerate(problems):
    if rank_problem is not None:
      raise error(rank, problems)
  return [rank_payload for _, rank_payload in gathered]
