"""The fp16 family's packed-batch variant, runtime side: the same kernels compiled for calls whose
sequences are packed along the rows (``cu_seqlens_q``/``cu_seqlens_k``, varlen.py), so the plain
kernels keep their registers. Same argument struct, same LDS layout, planned by f16.plan; route.py
chooses this family for packed calls."""

from __future__ import annotations

from ..names import NameSchema
from . import f16

NAME = "f16varlen"
NAMES = NameSchema("fa2_f16varlen", f16.NAMES.fields)
ARGS = f16.ARGS
lds_layout = f16.lds_layout
lds_bytes = f16.lds_bytes
