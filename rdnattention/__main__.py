"""python -m rdnattention, and the rdnattention command: info, doctor."""

from __future__ import annotations

import sys

from ._torch import problem


def main(argv: list[str] | None = None) -> int:
    why = problem()
    if why:
        print(f"rdnattention: error: {why}", file=sys.stderr)
        return 2
    from .cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
