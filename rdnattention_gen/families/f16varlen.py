"""The fp16 family's packed-batch variant (varlen_attn, flash_attn_varlen_func): the same template
and tiles as f16, compiled with VARLEN, so that batch b's query rows and keys start at its
cu_seqlens offsets. A family of its own so the plain f16 kernels stay as they are."""

from __future__ import annotations

from rdnattention.families import f16varlen as runtime

from ..spec import KernelSpec
from .f16 import F16


class F16Varlen(F16):
    name = "f16varlen"
    schema = runtime.NAMES
    tiles_family = "f16"
    oracle_cases: dict = {}  # tests/test_varlen.py runs its own sweep

    def context(self, spec: KernelSpec) -> dict:
        return {**super().context(spec), "varlen": True}


FAMILY = F16Varlen()
