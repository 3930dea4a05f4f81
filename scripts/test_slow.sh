#!/usr/bin/env bash
# The tests marked slow: tuning sweeps timed on the host emulator, hostile checkouts and build
# directories, a new target built from a YAML entry alone. CI runs them after scripts/test.sh.
set -euo pipefail
exec bash "$(dirname "$0")/test.sh" -m slow "$@"
