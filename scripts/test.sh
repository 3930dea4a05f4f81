#!/usr/bin/env bash
# Runs the test suite with the interpreter scripts/setup.sh installed into, without the tests marked
# slow (whole-pipeline runs: scripts/test_slow.sh, which CI runs too). Arguments go to pytest; a
# later -m replaces the default selection (bash scripts/test.sh -m "" runs everything). The 15 slowest
# tests are listed at the end, to keep the default run short.
# One pytest worker per core (pytest-xdist), each test file whole in one worker, in its order: the
# tests' Python runs on one core and the emulators' launches fill the rest; builds into the shared
# build directory take its lock (rdnattention_gen/build.py). -n 0 runs them in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
exec "$PYTHON" -m pytest -q --durations=15 -n auto --dist loadfile -m "not slow" "$@"
