"""Builds jdist's native exchange: `python -m jdist.collectives.native.build`.

Compiles `engine.cc` (the engine) and `ffi_cpu.cc` (the CPU FFI handler)
with the MPI compiler wrapper of the MPI that mpi4py uses (`mpicxx`, from
`$MPICXX`, the PATH or the Python environment's bin/), against the XLA FFI
headers of the installed jaxlib (`jax.ffi.include_dir()`), into `_build/` beside this file.
When a CUDA toolkit is found (`$CUDA_PATH`, /usr/local/cuda, or an `nvcc` on
PATH), `exchange_cuda.cc` is compiled too, linked to the CPU library.

scripts/install.sh runs it after installing jax and mpi4py. A failed build is
reported, not fatal: jdist then takes the callback route (`jdist info` says
which). Exit status: 0 built, 1 the CPU library failed; a failed CUDA build
is reported and leaves the CPU library in place.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

from jdist.collectives.native import BUILD_DIR
from jdist.collectives.native import CPU_LIBRARY
from jdist.collectives.native import CUDA_LIBRARY
from jdist.collectives.native import HERE
# The CPU library's translation units: the engine, and the FFI handlers that post to it
# (deferred.cc: exchanges started in one step and finished in a later one).
CPU_SOURCES = ("engine.cc", "ffi_cpu.cc", "deferred.cc")
FLAGS = ["-O3", "-DNDEBUG", "-std=c++17", "-fPIC", "-shared", "-pthread", "-Wall"]


def find_mpicxx() -> str | None:
  """The MPI C++ compiler wrapper: $MPICXX, the PATH, then the environment's bin/."""
  if os.environ.get("MPICXX"):
    return os.environ["MPICXX"]
  for name in ("mpicxx", "mpic++", "mpiCC"):
    found = shutil.which(name)
    if found:
      return found
    beside = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(beside):
      return beside
  return None


def find_cuda() -> str | None:
  """A CUDA toolkit root with headers and libcudart, or None."""
  candidates = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
  nvcc = shutil.which("nvcc")
  if nvcc:
    candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
  for root in candidates:
    if root and os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
      return root
  return None


def _run(argv: list[str], verbose: bool) -> None:
  if verbose:
    print(" ".join(argv))
  subprocess.run(argv, check=True)


def build(verbose: bool = False, cuda: bool | None = None) -> list[str]:
  """Compiles the libraries; returns the paths built.

  Args:
    verbose: print the compiler command lines.
    cuda: build the CUDA handler (None: when a toolkit is found).

  Raises:
    RuntimeError: no MPI compiler wrapper, or the CPU library did not compile.
  """
  import jax  # pylint: disable=import-outside-toplevel
  mpicxx = find_mpicxx()
  if mpicxx is None:
    raise RuntimeError("no MPI C++ compiler wrapper (mpicxx) on PATH or in the environment; "
                       "set MPICXX to the one of the MPI that mpi4py uses")
  include = jax.ffi.include_dir()
  os.makedirs(BUILD_DIR, exist_ok=True)
  built = []
  partial = CPU_LIBRARY + ".tmp"
  try:
    sources = [os.path.join(HERE, name) for name in CPU_SOURCES]
    _run([mpicxx, *FLAGS, "-isystem", include, *sources, "-o", partial], verbose)
  except subprocess.CalledProcessError as err:
    raise RuntimeError(f"compiling {', '.join(CPU_SOURCES)} with {mpicxx} failed ({err})") from None
  os.replace(partial, CPU_LIBRARY)  # atomic: a running job never sees half a library
  built.append(CPU_LIBRARY)
  root = find_cuda() if cuda is not False else None
  if cuda and root is None:
    raise RuntimeError("cuda=True but no CUDA toolkit (cuda_runtime.h) was found")
  if root is not None:
    lib = next((os.path.join(root, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")
                if os.path.exists(os.path.join(root, d))), os.path.join(root, "lib64"))
    partial = CUDA_LIBRARY + ".tmp"
    compiler = os.environ.get("CXX", "c++")
    try:
      _run([compiler, *FLAGS, "-isystem", include, "-isystem", os.path.join(root, "include"),
            os.path.join(HERE, "exchange_cuda.cc"), "-o", partial,
            f"-L{BUILD_DIR}", "-ljdist_exchange", "-Wl,-rpath,$ORIGIN",
            f"-L{lib}", "-lcudart", f"-Wl,-rpath,{lib}"], verbose)
      os.replace(partial, CUDA_LIBRARY)
      built.append(CUDA_LIBRARY)
    except subprocess.CalledProcessError as err:
      print(f"native build: the CUDA handler did not compile ({err}); GPUs will use the "
            f"callback route", file=sys.stderr)
  return built


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jdist.collectives.native.build",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("-v", "--verbose", action="store_true", help="print compiler commands")
  parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA handler")
  args = parser.parse_args(argv)
  try:
    built = build(verbose=args.verbose, cuda=False if args.no_cuda else None)
  except RuntimeError as err:
    print(f"native build: {err}", file=sys.stderr)
    return 1
  for path in built:
    print(f"native build: {os.path.relpath(path)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
