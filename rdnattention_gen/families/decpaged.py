"""Split-KV decode over a paged KV cache (``block_table``): the dec family's template and tiles,
compiled with PAGED, so that the contiguous kernels hold no page state (the page lookup's scalar
registers spilled on GCN when both lived in one kernel)."""

from __future__ import annotations

from rdnattention.families import decpaged as runtime

from ..spec import KernelSpec
from .dec import Dec


class DecPaged(Dec):
    name = "decpaged"
    schema = runtime.NAMES
    tiles_family = "dec"

    def context(self, spec: KernelSpec) -> dict:
        return {**super().context(spec), "paged": True}


FAMILY = DecPaged()
