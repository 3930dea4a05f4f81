"""The fp16 family's cache-length variant, runtime side: the same kernels compiled for calls that
give per-sequence key counts (``seqused_k``), so the plain kernels keep reading seq_k from their
arguments. Same argument struct, same LDS layout, planned by f16.plan; route.py chooses this family
for calls with cache lengths."""

from __future__ import annotations

from ..names import NameSchema
from . import f16

NAME = "f16len"
NAMES = NameSchema("fa2_f16len", f16.NAMES.fields)
ARGS = f16.ARGS
lds_layout = f16.lds_layout
lds_bytes = f16.lds_bytes
