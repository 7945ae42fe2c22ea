#!/usr/bin/env bash
# The whole test suite, in the three topologies (processes x devices):
#   1 x 4   plain pytest, every test (fault injection and CLI jobs included)
#   2 x 1   mpirun -np 2 pytest, the tests that exchange across processes
#   2 x 2   the same with two devices per process (the hierarchical route)
# then the docs build. Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${JDIST_VENV:-.venv}
export PATH="$PWD/$venv/bin:$PATH"
python="$venv/bin/python"
# One JAX compilation cache for the three sessions and every job their tests
# launch (fresh each run): the same steps compile once, not once per job.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR=$(mktemp -d -t jdist-jax-cache.XXXXXX)
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

# Tests that involve no cross-process exchange run once, in the plain session;
# jobs that end a whole MPI job (fault injection) or launch their own mpirun
# are named test_fault_* / *subprocess* and run only there.
mpi_selection=(tests --ignore=tests/test_data.py --ignore=tests/test_datasets.py
               --ignore=tests/test_models.py --ignore=tests/test_benchmarks.py
               --ignore=tests/test_watchdog.py --ignore=tests/test_network_bench.py
               --ignore=tests/test_launch.py --ignore=tests/test_cluster.py
               --ignore=tests/test_layout.py --ignore=tests/test_registry.py
               --ignore=tests/test_jax_internals.py
               -k "not test_fault and not subprocess"
               --capture=sys)

# The plain session's tests run on every core (pytest-xdist), a file's tests on
# one worker (the rig's tests take turns: conftest.py): most of their time is XLA compiling
# on one core or waiting for the jobs they launch.
workers=${JDIST_TEST_WORKERS:-auto}
echo "== tests: 1 process x 4 devices ($workers workers)"
"$python" -m pytest tests -n "$workers" --dist loadfile --durations=15 "$@"
# Every test process and launched job compiles each program as one LLVM module
# (tests/launch.py): two workers, or two ranks, already fill the cores. In the
# MPI sessions the tests run in the pytest processes (no launched jobs), where
# compiling is most of the time: LLVM's level 0 took the 2x1 session from 355 to
# 273 s (back to back, nothing else running). The plain session keeps level 1:
# its launched training jobs run slower at level 0, and its own tests gained
# nothing (838 s against 792 s).
mpi_xla_flags="--xla_backend_optimization_level=0 ${XLA_FLAGS:-}"
for devices in 1 2; do
  echo "== tests: 2 processes x $devices device(s)"
  XLA_FLAGS=$mpi_xla_flags bash scripts/mpirun.sh -np 2 -x XLA_FLAGS \
    -x JDIST_TEST_DEVICES=$devices "$python" -m pytest "${mpi_selection[@]}" --durations=10 "$@"
done
if [ -f mkdocs.yml ]; then
  echo "== docs: mkdocs build --strict"
  "$python" -m mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
fi
