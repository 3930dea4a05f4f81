"""Split-KV decode over a paged KV cache (``block_table``): the dec family's template and tiles,
compiled with PAGED, so that the contiguous kernels hold no page state (the page lookup's scalar
registers spilled on GCN when both lived in one kernel)."""

from __future__ import annotations

from rdnattention.families import decpaged as runtime

from ..family import OracleCase
from ..spec import KernelSpec
from .dec import Dec


class DecPaged(Dec):
    name = "decpaged"
    schema = runtime.NAMES
    tiles_family = "dec"
    # A page pool in shuffled page order; seq_k: pages per sequence x page_size.
    oracle_cases = {
        "paged": OracleCase(2, 4, 2, 1, 256, {"page_size": 16, "seqused_k": (256, 100)}),
        "paged_causal": OracleCase(2, 4, 2, 3, 128, {"page_size": 64, "is_causal": True, "seqused_k": (128, 70)}),
    }

    def context(self, spec: KernelSpec) -> dict:
        return {**super().context(spec), "paged": True}


FAMILY = DecPaged()
