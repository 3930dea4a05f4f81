"""Split-KV decode over a paged KV cache, runtime side: the dec family's kernels compiled for
``block_table`` calls. Same argument struct and LDS layout, planned by dec.plan; route.py chooses
this family for paged calls."""

from __future__ import annotations

from ..names import NameSchema
from . import dec

NAME = "decpaged"
NAMES = NameSchema("fa2_decpaged", dec.NAMES.fields)
ARGS = dec.ARGS
lds_layout = dec.lds_layout
lds_bytes = dec.lds_bytes
