"""Process-wide settings of XLA's CPU client that `jdist.init()` makes.

XLA reads them once, when JAX creates its backends, so `jdist.init()` sets
them first thing, and only where the user has not: a setting already in the
environment (`NPROC`, or the flag in `XLA_FLAGS`) is left as it is.

* `reserve_host_threads`: `NPROC`, the CPU client's thread pool, large
  enough for host callbacks blocked in MPI (jobs launched by MPI only).
* `avoid_slow_concatenation`: `--xla_cpu_use_fusion_emitters=false`, XLA's
  previous CPU fusion code generator, in every job on the JAX releases where
  it was measured (see its docstring for the numbers).
"""

from __future__ import annotations

import os

import jax

from jdist import errors
from jdist.runtime import jax_internals

MIN_HOST_THREADS = 16

FUSION_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters"
# The releases whose XLA has the flag and was measured with it (jax_internals.TESTED_JAX):
# XLA stops the process at an XLA_FLAGS entry it does not know.
_FUSION_EMITTERS_RELEASES = ((0, 10),)


def reserve_host_threads(jax_distributed: bool = True, backend: str = "mpi") -> None:
  """Gives XLA's CPU client enough threads for blocking cross-process calls.

  The callback route needs it (the native route's custom calls return at
  once and block no thread), and so do jit steps over global arrays on the
  native route, whose XLA all-reduces between the local devices block pool
  threads beside the exchanges (`routes._warn_small_thread_pool`), so every
  job with several devices per process gets the threads. XLA sizes the CPU client's thread pool from the
  NPROC environment variable, else the core count. With several local
  devices, each device's host callback blocks a pool thread inside MPI until
  its peer on the other process arrives; on a 2-core machine the pool (2
  threads) is then full and the work the other device still needs never
  runs: a deadlock on both processes (measured: 2 processes x 2 devices,
  buffers >= 64K floats). Extra pool threads cost nothing while idle.

  Args:
    jax_distributed: whether `jdist.init` starts JAX's distributed runtime
      next (it cannot start after JAX's backends either): the error's advice
      then says how to turn it off too.
    backend: `jdist.init`'s backend ("jax" always needs the runtime).

  Raises:
    jdist.errors.InitOrderError: JAX created its backends before this call
      (a `jax.devices()` or an array came first), so the pool kept fewer than
      `MIN_HOST_THREADS` threads, and this process drives several CPU
      devices: its first cross-process step would deadlock (2 x 2 hung at
      step 1 with no report). One device per process, or a pool that was
      large enough, goes on.
  """
  if "NPROC" in os.environ:
    return
  if jax_internals.backends_initialized():
    pool = os.cpu_count() or 1
    devices = jax.local_device_count()
    if jax.default_backend() == "cpu" and devices > 1 and pool < MIN_HOST_THREADS:
      raise errors.InitOrderError(
          f"jdist.init() ran after JAX started its backends (a jax.devices() call, an "
          f"array or a computation came first), so XLA's CPU thread pool kept its "
          f"{pool} threads, too few for {devices} devices per process exchanging across "
          f"processes: the first step would deadlock. "
          + late_init_advice(jax_distributed, backend))
    return
  os.environ["NPROC"] = str(max(os.cpu_count() or 1, MIN_HOST_THREADS))


def late_init_advice(jax_distributed: bool, backend: str = "mpi") -> str:
  """How to fix a `jdist.init()` that came after JAX's backends with several CPU devices.

  Each fix works as written in its case: with JAX's distributed runtime on
  (the default under mpirun), `NPROC` alone only leads to the runtime's own
  `InitOrderError`, so the advice names both variables.
  """
  first = "Fix: call jdist.init() before any other JAX call (right after the imports)"
  if backend == "jax":
    return (f"{first}: that is the only fix with backend='jax', whose collectives need "
            f"JAX's distributed runtime, which cannot start after JAX's backends either.")
  if jax_distributed:
    return (f"{first}. That is the only fix while JAX's distributed runtime is on (the "
            f"default under mpirun): it cannot start after JAX's backends either. To keep "
            f"this order instead, enlarge the pool and turn the runtime off together: start "
            f"the job with NPROC={MIN_HOST_THREADS} and JDIST_JAX_DISTRIBUTED=0 in the "
            f"environment (mpirun -x NPROC={MIN_HOST_THREADS} -x JDIST_JAX_DISTRIBUTED=0 ...; "
            f"jax.process_index() is then 0 on every rank).")
  return (f"{first}, or start the job with NPROC={MIN_HOST_THREADS} in the environment "
          f"(mpirun -x NPROC={MIN_HOST_THREADS} ...).")


def _release(version: str) -> tuple[int, int]:
  major, minor = version.split(".")[:2]
  return int(major), int(minor)


def avoid_slow_concatenation() -> bool:
  """Selects XLA's previous CPU fusion emitters, unless the user chose.

  With more than one thread in XLA's CPU pool (any multi-core machine, and
  `NPROC` above), the fusion emitters of jax 0.10 run a concatenation of
  reshaped (2-D and larger) arrays about ten times slower than one thread
  does: raveling the 10M-parameter MLP's gradient into one vector took
  251-472 ms with NPROC=2 against 23 ms with NPROC=1 or with the previous
  emitters (jax 0.10.2, one process). Gradient fusion (`jdist.fusion`) and
  the top-K, threshold and error-feedback paths build such vectors every
  step: 2 processes x 1 device, 10M-parameter MLP, top-K 1% took 2,649 ms a
  step, 310 ms with this flag; threshold 2,671 -> 255 ms, block top-K
  570 -> 151 ms, while the plain step (62.6 / 58.4 ms) and SINGA's CNN
  (compute 15.4-16.2 / 12.2-15.3 ms) did not slow down
  (docs/troubleshooting.md, "Slow concatenation on CPU").

  Returns:
    True when the flag was added to `XLA_FLAGS`; False where the user set it,
    JAX's backends already exist, or this JAX release was not measured.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if FUSION_EMITTERS_FLAG in flags or jax_internals.backends_initialized():
    return False
  if _release(jax.__version__) not in _FUSION_EMITTERS_RELEASES:
    return False
  os.environ["XLA_FLAGS"] = " ".join(flags.split() + [f"{FUSION_EMITTERS_FLAG}=false"])
  return True
