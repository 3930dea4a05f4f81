"""The fp16 family's cache-length variant (``seqused_k``): the same template and tiles as f16, the
kernel compiled with LENGTHS, so that batch b attends to its first seqused_k[b] keys. A family of its
own so the plain f16 kernels stay as they are (a per-batch key count held in registers cost 5% at
head_dim 64 on the H200)."""

from __future__ import annotations

from rdnattention.families import f16len as runtime

from ..family import OracleCase
from ..spec import KernelSpec
from .f16 import F16


class F16Len(F16):
    name = "f16len"
    schema = runtime.NAMES
    tiles_family = "f16"  # takes f16's tiles from every tile table
    # Enough query rows per K/V head for the row-block kernels; a used length of 0 is an empty row.
    oracle_cases = {
        "lengths": OracleCase(3, 2, 2, 16, 100, {"seqused_k": (100, 37, 0)}),
        "causal_gqa": OracleCase(2, 4, 2, 24, 90, {"is_causal": True, "seqused_k": (90, 30)}),
        "window": OracleCase(2, 2, 2, 20, 80, {"window_size": (16, 3), "seqused_k": (80, 41)}),
    }

    def context(self, spec: KernelSpec) -> dict:
        return {**super().context(spec), "lengths": True}


FAMILY = F16Len()
