#!/usr/bin/env bash
# The main job: SINGA's CNN on the bundled digits set (no download), data-parallel
# over 2 MPI processes x 2 CPU devices each. Extra arguments go to `jdist train`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/mpirun.sh -np 2 "${JDIST_VENV:-.venv}/bin/jdist" train \
  --cpu-devices 2 --model cnn --dataset digits --epochs 8 --batch-size 16 \
  --lr 0.05 --momentum 0.9 "$@"
