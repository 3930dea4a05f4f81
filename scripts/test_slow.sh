#!/usr/bin/env bash
# The tests marked slow: tuning sweeps timed on the host emulator, hostile checkouts and build
# directories, a new target built from a YAML entry alone. CI runs them after scripts/test.sh.
set -euo pipefail
# --dist load: the tests go to the workers one by one, not a file at a time, so the ISA emulator's
# sweep of every gfx1100 kernel (one file, most of this run) is shared by both.
exec bash "$(dirname "$0")/test.sh" -m slow --dist load "$@"
