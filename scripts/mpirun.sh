#!/usr/bin/env bash
# mpirun from the jdist environment, with the flags this kind of machine needs:
# --oversubscribe (more ranks than cores is fine for CPU runs) and, when run as
# root (containers), --allow-run-as-root. Usage: bash scripts/mpirun.sh -np 2 CMD...
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${JDIST_VENV:-$here/.venv}"
export PATH="$venv/bin:$PATH"
flags=(--oversubscribe)
[ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
exec mpirun "${flags[@]}" "$@"
