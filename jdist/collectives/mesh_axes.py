"""`jdist.mesh(model=K)`: a data axis across processes beside a model axis within one.

`jdist.mesh()` is one axis, `jdist.DATA_AXIS`, over the local devices. With
`model=K` it is two, (data, model): rows of K consecutive local devices.
XLA shards parameters over the model axis (`NamedSharding(mesh, P(None,
"model"))`) and the batch over the data axis within the process, and
computes each process's gradient, laid out like its parameter; jdist adds
the exchange between processes. The model axis never leaves a process:
jdist's cross-process exchange runs on the data axis only.

A global step's reduction (`jdist.collectives.context.per_process`) runs in
a `shard_map` where a one-axis mesh names each device: jdist's routes reduce
over `DATA_AXIS` and key each device's cross-process exchange by its place
on that axis. Over the two-axis mesh, the devices of one model row share a
data index, so they would run their exchanges on one MPI communicator at
once and could pair with another process's device of a different shard
(silently wrong sums). So the reduction runs over `exchange_mesh`: the same
devices, data-major, as one `DATA_AXIS` axis. Its input is the whole value
(XLA gathers a model-sharded gradient over its row first); the mesh's first
device contributes it and every device gets the process sum back, which XLA
lays out again as the parameter's shard. Every shard is thus summed with the
same shard of every other process, and compressed payloads (top-K, PowerSGD,
16-bit) travel as they do without a model axis.

The data axis may carry another name (`names=("batch", "model")`, the
axis names of JAX's miniGPT tutorial): jdist remembers which axis of each
mesh it built is the data axis.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh

from jdist import errors
from jdist.collectives.wire import DATA_AXIS

MODEL_AXIS = "model"


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What jdist reads from a two-axis mesh it built."""
  data: str        # the data axis's name
  model: str       # the model axis's name
  exchange: Mesh   # the same devices, data-major, on the one axis DATA_AXIS


# Keyed by the abstract mesh, which is all a traced step sees of its mesh.
_layouts: dict[AbstractMesh, _Layout] = {}


def _divisors(n: int) -> tuple[int, ...]:
  return tuple(k for k in range(1, n + 1) if n % k == 0)


def _check(model, names, local: int) -> tuple[str, str] | None:
  """The checked `names` (None: the one-axis mesh), or a ValueError naming what is wrong."""
  if isinstance(model, bool) or not isinstance(model, (int, np.integer)) or model < 1:
    raise ValueError(f"model={model!r} must be a positive int: the model axis's size "
                     f"(1: no model axis).")
  if model > local:
    raise ValueError(
        f"model={model} is more than this process's {local} local devices: the model axis "
        f"shards parameters within one process, never across processes (jdist's exchange "
        f"between processes runs on the data axis only). Choose model in "
        f"{_divisors(local)}, or run fewer processes with more devices each.")
  if local % model:
    raise ValueError(
        f"model={model} does not divide this process's {local} local devices into whole "
        f"model rows (the data axis has local_devices / model slots per process). Choose "
        f"model in {_divisors(local)}.")
  if names is None:
    return None if model == 1 else (DATA_AXIS, MODEL_AXIS)
  if (isinstance(names, str) or not isinstance(names, Sequence) or len(names) != 2
      or not all(isinstance(n, str) and n for n in names) or names[0] == names[1]):
    raise ValueError(f"names={names!r} must be two different axis names, (data, model), "
                     f"e.g. ('batch', 'model').")
  if names[1] == DATA_AXIS:
    raise ValueError(f"names={tuple(names)!r} names the model axis {DATA_AXIS!r}, which jdist "
                     f"reads as the data axis (jdist.DATA_AXIS); name it e.g. "
                     f"{MODEL_AXIS!r}.")
  return tuple(names)


def build(devices: Sequence[jax.Device], local: int, model: int = 1,
          names: Sequence[str] | None = None) -> Mesh:
  """The mesh of `jdist.mesh(model, names)` over `devices`.

  Args:
    devices: the devices of the mesh (this process's; with the "jax"
      backend, every process's, process by process).
    local: local devices per process.
    model: the model axis's size; it must divide `local`.
    names: (data axis, model axis); None: (`DATA_AXIS`, "model"), or the
      one-axis mesh where `model` is 1.

  Returns:
    A `Mesh`: one axis `DATA_AXIS`, or (data, model) of shape
    [len(devices) / model, model].

  Raises:
    ValueError: a bad `model` or `names` (see `jdist.mesh`).
  """
  checked = _check(model, names, local)
  flat = np.asarray(devices)
  if checked is None:
    return Mesh(flat, (DATA_AXIS,))
  grid = flat.reshape(-1, model)
  rows = {tuple(sorted({d.process_index for d in row})) for row in grid}
  if any(len(r) != 1 for r in rows):  # the devices are not grouped by process
    raise ValueError(f"model={model}: a model row would span processes "
                     f"({[list(r) for r in grid]}); jdist's model axis stays within one.")
  built = Mesh(grid, checked)
  _layouts[built.abstract_mesh] = _Layout(checked[0], checked[1], Mesh(flat, (DATA_AXIS,)))
  return built


def data_axis(abstract: AbstractMesh) -> str | None:
  """The data axis of a global step's mesh, or None where it has none.

  Raises:
    jdist.errors.CollectiveContextError: a mesh with `DATA_AXIS` and other
      axes that `jdist.mesh` did not build (jdist would not know how its
      devices exchange across processes).
  """
  layout = _layouts.get(abstract)
  if layout is not None:
    return layout.data
  if DATA_AXIS not in abstract.axis_names:
    return None
  if len(abstract.axis_names) > 1 and DATA_AXIS not in abstract.manual_axes:
    raise errors.CollectiveContextError(
        f"jdist's reductions run in a jit step over a mesh with axes {abstract.axis_names} "
        f"that jdist.mesh did not build. Build it with jdist.mesh(model=K) (axes "
        f"({DATA_AXIS!r}, {MODEL_AXIS!r})) or jdist.mesh(model=K, names=(data, model)): "
        f"jdist then knows which axis spans processes.")
  return DATA_AXIS


def exchange_mesh(abstract: AbstractMesh) -> Mesh | None:
  """The one-axis mesh a global step's reduction runs over; None: the step's own mesh."""
  layout = _layouts.get(abstract)
  return None if layout is None else layout.exchange


def refuse_per_replica_step(what: str) -> None:
  """Raises where a `jdist.data_parallel` step is called under a two-axis jdist mesh.

  Such a step makes each local device a replica holding whole parameters:
  it has no model axis, and JAX refuses its one-axis `shard_map` under the
  two-axis context mesh with a message that names neither.

  Raises:
    jdist.errors.CollectiveContextError: names both ways out.
  """
  abstract = jax.sharding.get_abstract_mesh()
  layout = _layouts.get(abstract)
  if layout is None or abstract.manual_axes:
    return
  raise errors.CollectiveContextError(
      f"{what} is a jdist.data_parallel step (every local device a replica with whole "
      f"parameters), called under jax.set_mesh(jdist.mesh(model="
      f"{abstract.shape[layout.model]}, ...)), whose model axis {layout.model!r} it cannot "
      f"use. For a model axis, write the step as a jax.jit step over global arrays under "
      f"that mesh (docs/model_axis.md); for data parallelism alone, call this step outside "
      f"it (under jax.set_mesh(jdist.mesh()) or no mesh).")
