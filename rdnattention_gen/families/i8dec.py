"""Split-KV decode over int8 Q, K, V: the dec family's kernel (templates/include/fa2_decode.h) with
the int8 element policy (fa2_i8_decode.h): 16 int8 values of each key per lane, scores through the
target's dot4 with the per-token Q and K scales, V's per-channel scale at the end. Built where the
INT8 family is (targets with an int8 dot); its slices are merged by the combine family."""

from __future__ import annotations

from rdnattention.families import i8dec as runtime

from ..family import HeadDimAxis, OracleCase
from ..spec import KernelSpec
from .dec import decode_rules, waves_per_simd
from .i8 import I8


class I8Dec(HeadDimAxis, I8):
    name = "i8dec"
    template = "fa2_i8dec.hip.j2"
    args = runtime.ARGS
    schema = runtime.NAMES
    rules = decode_rules(runtime.LANE_VALUES)
    # As i8's, with at most 8 query rows per K/V head (route.SPLIT_KV_MAX_ROWS).
    oracle_cases = {
        "decode": OracleCase(2, 4, 2, 1, 203),
        "rows_causal": OracleCase(1, 8, 2, 2, 150, {"is_causal": True}),
        "window": OracleCase(1, 2, 2, 3, 120, {"window_size": (40, 0)}),
    }

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        return runtime.lds_layout(spec.head_dim, spec.tile.threads, spec.tile.br, spec.wave_size)

    def context(self, spec: KernelSpec) -> dict:
        return {"lds_bytes": self.lds_bytes(spec), "waves": waves_per_simd(spec)}


FAMILY = I8Dec()
