#!/usr/bin/env bash
# Runs the test suite with the interpreter scripts/setup.sh installed into.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
exec "$PYTHON" -m pytest -q "$@"
