"""The fp16 family's packed-batch variant (varlen_attn, flash_attn_varlen_func): the same template
and tiles as f16, compiled with VARLEN, so that batch b's query rows and keys start at its
cu_seqlens offsets. A family of its own so the plain f16 kernels stay as they are."""

from __future__ import annotations

from rdnattention.families import f16varlen as runtime

from ..family import OracleCase
from ..spec import KernelSpec
from .f16 import F16


class F16Varlen(F16):
    name = "f16varlen"
    schema = runtime.NAMES
    tiles_family = "f16"
    # Packed batches (batch, seq_q, seq_k: the count and the longest of the lengths).
    oracle_cases = {
        "packed": OracleCase(3, 2, 2, 30, 60, {"seqlens_q": (30, 1, 17), "seqlens_k": (30, 60, 17)}),
        "causal_gqa": OracleCase(2, 4, 2, 20, 50, {"is_causal": True, "seqlens_q": (20, 9), "seqlens_k": (50, 9)}),
        "window": OracleCase(2, 2, 2, 40, 70, {"window_size": (21, 9), "seqlens_q": (12, 40), "seqlens_k": (70, 40)}),
    }

    def context(self, spec: KernelSpec) -> dict:
        return {**super().context(spec), "varlen": True}


FAMILY = F16Varlen()
