"""Runs a Python program with torch's SDPA patched (rdnattention.patch_sdpa), for programs that
never import rdnattention themselves:

    python -m rdnattention.patched main.py --its --arguments
    python -m rdnattention.patched -m some.module --its --arguments

$RDNATTENTION_PATCH_SDPA chooses the devices as on import (``cpu``, ``cuda``, ``cuda,cpu``); unset,
the GPUs. The program runs as ``__main__`` with its own ``sys.argv``, as under ``python``."""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m rdnattention.patched (SCRIPT | -m MODULE) [ARGUMENTS...]"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(USAGE, file=sys.stderr if argv[:1] != ["-h"] and argv[:1] != ["--help"] else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    os.environ.setdefault("RDNATTENTION_PATCH_SDPA", "1")  # children that import rdnattention patch too
    from ._torch import problem

    why = problem()
    if why:
        print(f"rdnattention.patched: error: {why}", file=sys.stderr)
        return 2
    import rdnattention
    from .integrations.sdpa import patch_from_env

    if not rdnattention.stats()["patched"]:  # imported before the variable was set
        patch_from_env()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
