#!/usr/bin/env bash
# `make test`: every test, in the least time two cores allow without one test stretching
# another's time bounds (docs/testing.md, "How `make test` runs the suite").
#   1. ruff and mypy in the background (one core at most), beside
#   2. the modules that are not heavy, over two xdist workers, a module to a worker (its stack
#      booted once): together they keep the cores about 65 % busy, so the lint fits in the gaps;
#   3. the heavy modules in two lanes side by side, one module at a time in each: the CPU-bound
#      ones (tests/conftest.py HEAVY_CPU) and the ones bounded by real time (HEAVY_TIMED).
# A lane's output is printed whole when it ends (two lanes interleaved line by line could not be
# read). Every run runs even after a failure, so one CI run shows every failure; the exit status
# is the first failure's. Arguments go to every pytest run (`make test ARGS=tests/test_x.py`).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
status=0
failed() { [ "$status" -ne 0 ] || status=$1; }
pytest() { "$PY" -m pytest -q -rs --durations=15 "$@"; }

echo "== lint and typecheck (in the background)"
make --no-print-directory lint typecheck >"$logs/lint" 2>&1 &
lint=$!

echo "== the modules that are not heavy (two xdist workers)"
pytest -n 2 --dist loadfile -m "not heavy" "$@" || failed $?

wait "$lint" || failed $?
echo "== lint and typecheck"
cat "$logs/lint"

echo "== the heavy modules, two lanes: bounded by real time (printed when it ends) and CPU-bound"
pytest -m heavy_timed "$@" >"$logs/timed" 2>&1 &
timed=$!
pytest -m "heavy and not heavy_timed" "$@" || failed $?
wait "$timed" || failed $?
echo "== the heavy modules bounded by real time"
cat "$logs/timed"
exit "$status"
