"""Errors jdist raises: each says what is wrong and how to fix it."""


class JdistError(RuntimeError):
  """Base class of jdist's own errors."""


class MissingMPIError(JdistError):
  """Launched by mpirun, but the MPI Python packages are not importable."""


class CollectiveContextError(JdistError):
  """A collective was called outside a function run by `jdist.data_parallel`."""


class ShapeError(JdistError, ValueError):
  """An input does not fit the topology (e.g. batch not divisible by devices)."""


class StructureMismatchError(JdistError):
  """Processes tried to exchange pytrees of different structure/shape/dtype."""


class CheckpointError(JdistError):
  """A checkpoint cannot be written or does not fit this run."""


class CheckpointCorruptError(CheckpointError):
  """A checkpoint's files cannot be read: damaged, truncated or partly deleted."""


class WorldMismatchError(JdistError):
  """The processes of one job differ where they must agree (devices, settings, data)."""


class InitOrderError(JdistError):
  """`jdist.init()` ran too late: JAX had started its backends in a way the job cannot use."""


class CoordinatorError(JdistError):
  """JAX's distributed runtime could not start: its coordinator was not reached in time."""
