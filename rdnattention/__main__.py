"""python -m rdnattention: the rdnattention command (info, doctor)."""

import sys

from .cli import main

sys.exit(main())
