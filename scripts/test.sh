#!/usr/bin/env bash
# The test command: lint, the whole suite on virtual ranks, then the MPI suite under mpiexec -n 2 and 4.
# Run it from the repository root after `pip install -e ".[mpi,test]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
mpiexec=$(dirname "$(command -v "$py")")/mpiexec
[ -x "$mpiexec" ] || mpiexec=mpiexec

"$py" -m ruff check .
"$py" -m ruff format --check .
timeout 900 "$py" -m pytest -q
for n in 2 4; do
  echo "== MPI tests under mpiexec -n $n"
  timeout 600 "$mpiexec" -n "$n" "$py" -m pytest -q tests/mpi
done
