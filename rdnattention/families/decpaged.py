"""Split-KV decode over a paged KV cache, runtime side: the dec family's kernels compiled for
``block_table`` calls. Same argument struct and LDS layout; dec.plan chooses this family when the
call has a block table."""

from __future__ import annotations

from ..names import NameSchema
from . import dec

NAME = "decpaged"
NAMES = NameSchema("fa2_decpaged", dec.NAMES.fields)
ARGS = dec.ARGS
lds_layout = dec.lds_layout
lds_bytes = dec.lds_bytes
Call = dec.Call
plan = dec.plan
