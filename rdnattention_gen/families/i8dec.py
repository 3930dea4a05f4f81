"""Split-KV decode over int8 Q, K, V: the dec family's algorithm and kernel body
(templates/include/fa2_decode.h) with the int8 element policy (fa2_i8_decode.h): 16 int8 values of
each key per lane, scores through the target's dot4 with the per-token Q and K scales, V's
per-channel scale at the end. Its own tiles and tile space (lane groups of head_dim / 16 lanes) and
its own product count. Built on the targets with an int8 dot, as the INT8 family is; its slices are
merged as dec's are, by the last to finish."""

from __future__ import annotations

from rdnattention.families import i8dec as runtime

from ..family import OracleCase
from ..spec import KernelSpec
from ..target import Target
from .dec import Dec, decode_rules, waves_per_simd
from .i8 import I8


class I8Dec(Dec):
    name = "i8dec"
    template = "fa2_i8dec.hip.j2"
    args = runtime.ARGS
    schema = runtime.NAMES
    lane_values = runtime.LANE_VALUES
    rules = decode_rules(runtime.LANE_VALUES)
    signatures = I8.signatures
    layouts = {}  # [batch, heads, seq, head_dim] tensors only (flash_attn_int8qk)
    dtypes = {}   # int8 only
    # As i8's, with at most 8 query rows per K/V head (route.SPLIT_KV_MAX_ROWS).
    oracle_cases = {
        "decode": OracleCase(2, 4, 2, 1, 203),
        "rows_causal": OracleCase(1, 8, 2, 2, 150, {"is_causal": True}),
        "window": OracleCase(1, 2, 2, 3, 120, {"window_size": (40, 0)}),
    }

    def tier(self, target: Target) -> str | None:
        return I8.tier(self, target)

    def stage(self, target: Target) -> str:
        return "i8"

    def products_per_step(self, spec: KernelSpec) -> float | None:
        # Each lane holds 16 values of its keys: four dot4 per key and row for the scores, over the
        # bc / (threads / (head_dim / 16)) keys of its lane group per step (P.V is in fp32).
        lanes = spec.head_dim // self.lane_values
        return spec.tile.br * spec.tile.bc * lanes / spec.tile.threads * (self.lane_values // 4)

    def context(self, spec: KernelSpec) -> dict:
        return {"lds_bytes": self.lds_bytes(spec), "waves": waves_per_simd(spec)}


FAMILY = I8Dec()
