#!/usr/bin/env bash
# `make test`: every test, in the least time two cores allow without one test stretching
# another's time bounds (docs/testing.md, "How `make test` runs the suite").
#   1. the modules that are not heavy, over two xdist workers, a module to a worker (its stack
#      booted once), the slowest handed out first (tests/conftest.py SLOW_FIRST); beside them the
#      container tests (HEAVY_DOCKER), which mostly wait on the Docker engine;
#   2. the heavy modules in two lanes side by side, one module at a time in each: the CPU-bound
#      ones (tests/conftest.py HEAVY_CPU), and the ones bounded by real time (HEAVY_TIMED),
#      then ruff and mypy, on the core that lane leaves idle;
#   3. the heavy modules that need the machine to themselves (HEAVY_ALONE: the browser's real-time
#      conversation), alone.
# A lane beside another is printed whole when it ends (two lanes interleaved line by line could
# not be read). Every run runs even after a failure, so one CI run shows every failure; the exit
# status is the first failure's. Arguments go to every pytest run (`make test ARGS=tests/test_x.py`).
# LINT=0 leaves ruff and mypy out (a quick local run of a few modules).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), every Python process of
# the suite (some 300 services, CLIs and pytest runs) would compile each module it imports anew,
# and each of the seven collections would rewrite every test module's asserts again: 5 s of CPU a
# collection, 0.3 s a process. The suite keeps its bytecode (__pycache__/, which git ignores).
unset PYTHONDONTWRITEBYTECODE
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
status=0
failed() { [ "$status" -ne 0 ] || status=$1; }
pytest() { "$PY" -m pytest -q -rs --durations=15 "$@"; }
# How long a step took and how busy it kept the machine's cores (from /proc/stat: busy jiffies
# over all jiffies, every core counted), so a run's log shows where time and cores go.
cpu() { awk '/^cpu /{print $2+$3+$4+$7+$8, $2+$3+$4+$5+$6+$7+$8}' /proc/stat 2>/dev/null || echo "0 0"; }
mark() { start=$SECONDS; read -r busy0 all0 < <(cpu); }
took() {
  local busy all
  read -r busy all < <(cpu)
  echo "== $1: $((SECONDS - start)) s, the cores $(( all > all0 ? 100 * (busy - busy0) / (all - all0) : 0 )) % busy"
}

echo "== the modules that are not heavy (two xdist workers), beside the container tests (printed when they end)"
mark
pytest -m heavy_docker "$@" >"$logs/docker" 2>&1 &
docker=$!
pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not heavy" "$@" || failed $?
wait "$docker" || failed $?
took "step 1"
echo "== the container tests"
cat "$logs/docker"

echo "== the heavy modules, two lanes: bounded by real time, then the lint (printed when it ends); CPU-bound"
(
  lane=0
  pytest -m heavy_timed "$@" || lane=$?
  if [ "${LINT:-1}" != 0 ]; then
    echo "== lint and typecheck"
    mark
    if ! make --no-print-directory lint typecheck; then [ "$lane" -ne 0 ] || lane=2; fi
    took "the lint"
  fi
  exit "$lane"
) >"$logs/timed" 2>&1 &
timed=$!
mark
pytest -m "heavy and not heavy_timed and not heavy_alone and not heavy_docker" "$@" || failed $?
wait "$timed" || failed $?
took "step 2"
echo "== the heavy modules bounded by real time"
cat "$logs/timed"

echo "== the heavy modules that need the machine to themselves (tests/conftest.py HEAVY_ALONE)"
mark
pytest -m heavy_alone "$@" || failed $?
took "step 3"
exit "$status"
