"""The INT8 family's quantization: q and k per token, v per channel, into int8 and fp32 scales, in
one launch; no products. Built where the INT8 attention kernels are (targets with an int8 dot); one
kernel per target, head_dim a launch argument up to the kernels' head_dim (runtime:
rdnattention/families/quant.py).

Kernel body: templates/include/fa2_quant.h."""

from __future__ import annotations

from rdnattention.families import quant as runtime

from ..family import Family, HeadDimAxis, OracleCase, Rule
from ..spec import KernelSpec, Tile
from ..target import Target
from .f16 import WHOLE_WAVES

RULES = (
    Rule("head_dim_max", lambda s, t: s.head_dim == runtime.HEAD_DIM_MAX,
         lambda s, t: f"head_dim {s.head_dim}: the quant kernels take head_dims up to {runtime.HEAD_DIM_MAX} "
                      "at launch and are built once, at that head_dim"),
    WHOLE_WAVES,
)


class Quant(HeadDimAxis, Family):
    name = "quant"
    template = "fa2_quant.hip.j2"
    head_dim_at_launch = True
    args = runtime.ARGS
    schema = runtime.NAMES
    rules = RULES
    signatures = {"f32": "none"}  # no product instruction to find
    # flash_attn_int8qk_quantized calls (tests/cases.py's _quantized): the int8 tensors and scales
    # it hands the attention must be the torch formula's bit for bit, and the output the oracle's on
    # them dequantized, at the head_dims below (the kernels take any at launch; the INT8 attention
    # is built at these). Every dtype, stride and edge value: tests/kernels/test_quant.py.
    oracle_cases = {
        "quantized": OracleCase(2, 4, 2, 7, 40),
        "quantized_causal": OracleCase(1, 4, 4, 9, 9, {"is_causal": True}),
        "quantized_decode": OracleCase(2, 8, 2, 1, 70),
    }
    launch_head_dims = (64, 128)
    tile_constraints = False  # one kernel per target, serving every call

    def tier(self, target: Target) -> str | None:
        return None if target.int8_dot == "none" else "f32"

    def _spec(self, head_dim: int, threads: int, wave_size: int) -> KernelSpec:
        return KernelSpec(family=self.name, head_dim=head_dim, gqa_group=1,
                          tile=Tile(br=1, bc=1, threads=threads, tm=1), wave_size=wave_size, tier="f32",
                          stage="f32")

    def spec(self, target: Target, point: dict, tile: Tile) -> KernelSpec:
        return self._spec(point["head_dim"], tile.threads, target.wave_size)

    def from_name(self, name: str) -> KernelSpec | None:
        v = self.schema.parse(name)
        return None if v is None else self._spec(v["head_dim"], v["tile.threads"], v["wave_size"])

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        return runtime.lds_layout(spec.tile.threads)

    def context(self, spec: KernelSpec) -> dict:
        return {"lds_bytes": self.lds_bytes(spec)}


FAMILY = Quant()
