"""Split-KV decode over int8 Q, K, V: the dec family's kernel (templates/include/fa2_decode.h) with
the int8 element policy (fa2_i8_decode.h): 16 int8 values of each key per lane, scores through the
target's dot4 with the per-token Q and K scales, V's per-channel scale at the end. Built where the
INT8 family is (targets with an int8 dot); its slices are merged by the combine family."""

from __future__ import annotations

from rdnattention.families import i8dec as runtime

from ..family import Family, HeadDimAxis, Rule
from ..matrix import Target
from ..spec import KernelSpec, Tile
from .dec import waves_per_simd
from .f16 import LDS_RULE
from .i8 import I8


def lanes_per_key(spec: KernelSpec) -> int:
    return spec.head_dim // runtime.LANE_VALUES


RULES = (
    Rule("head_dim_range",
         lambda s, t: s.head_dim % 16 == 0 and 16 <= s.head_dim <= 16 * s.wave_size
         and lanes_per_key(s) & (lanes_per_key(s) - 1) == 0,
         lambda s, t: f"head_dim {s.head_dim} must be 16 times a power of two, at most 16 * wave size = "
                      f"{16 * s.wave_size} (head_dim / 16 lanes share each key)", stop=True),
    Rule("whole_waves",
         lambda s, t: s.tile.threads % s.wave_size == 0,
         lambda s, t: f"threads {s.tile.threads} must be a multiple of the wave size {s.wave_size}"),
    Rule("rows_per_thread",
         lambda s, t: s.tile.tm == s.tile.br,
         lambda s, t: f"tm {s.tile.tm} must equal br {s.tile.br}: every thread holds all of the workgroup's rows"),
    Rule("keys_per_group",
         lambda s, t: s.tile.bc % (s.tile.threads // lanes_per_key(s)) == 0,
         lambda s, t: f"bc {s.tile.bc} must be a multiple of the lane groups threads / (head_dim / 16) = "
                      f"{s.tile.threads // lanes_per_key(s)}"),
    LDS_RULE,
)


class I8Dec(HeadDimAxis, Family):
    name = "i8dec"
    template = "fa2_i8dec.hip.j2"
    args = runtime.ARGS
    schema = runtime.NAMES
    rules = RULES
    signatures = I8.signatures
    oracle_cases: dict = {}  # tests/test_int8.py runs it against the dequantized oracle

    def tier(self, target: Target) -> str | None:
        return None if target.int8_dot == "none" else target.int8_dot

    def spec(self, target: Target, point: dict, tile: Tile) -> KernelSpec:
        return KernelSpec(family=self.name, head_dim=point["head_dim"], gqa_group=1, tile=tile,
                          wave_size=target.wave_size, tier=self.tier(target), stage="i8")

    def from_name(self, name: str) -> KernelSpec | None:
        v = self.schema.parse(name)
        if v is None:
            return None
        return KernelSpec(family=self.name, head_dim=v["head_dim"], gqa_group=v["gqa_group"],
                          tile=Tile(br=v["tile.br"], bc=v["tile.bc"], threads=v["tile.threads"], tm=v["tile.tm"]),
                          wave_size=v["wave_size"], tier=v["tier"], stage="i8")

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        return runtime.lds_layout(spec.head_dim, spec.tile.threads, spec.tile.br)

    def context(self, spec: KernelSpec) -> dict:
        return {"lds_bytes": self.lds_bytes(spec), "waves": waves_per_simd(spec)}


FAMILY = I8Dec()
