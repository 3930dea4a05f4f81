"""INT8 FlashAttention-2 forward: int8 Q, K, V with fp32 per-token (Q, K) and per-channel (V)
scales; both products through the target's int8 dot4, the softmax in fp32, fp16 output. Targets
without an int8 dot get no kernels of this family (the runtime says to use the fp16 kernel).

Kernel body: templates/include/fa2_i8.h, the int8 element policy and scales over the one
FlashAttention-2 main loop (fa2_forward.h), with a schedule policy of pipeline.h."""

from __future__ import annotations

from rdnattention.families import i8 as runtime

from ..family import OracleCase, Rule
from ..spec import KernelSpec, Tile
from ..target import Target
from .f16 import COLUMNS_RULE, GRID_RULES, LDS_RULE, F16, threads_per_row


RULES = (
    Rule("head_dim_range",
         lambda s, t: s.head_dim % 16 == 0 and 16 <= s.head_dim <= 256,
         lambda s, t: f"head_dim {s.head_dim} must be a multiple of 16 in 16..256"),
    *GRID_RULES,
    Rule("key_quads_per_lane",
         lambda s, t: s.tile.bc % (4 * threads_per_row(s)) == 0,
         lambda s, t: f"bc {s.tile.bc} must be a multiple of 4 * threads per row = {4 * threads_per_row(s)} "
                      "(each lane quantizes whole quads of keys of P)"),
    COLUMNS_RULE,
    LDS_RULE,
)


class I8(F16):
    name = "i8"
    template = "fa2_i8.hip.j2"
    args = runtime.ARGS
    schema = runtime.NAMES
    rules = RULES
    # Every int8 kernel must contain the target's dot4 instruction.
    signatures = {"sdot4": "dot4", "sudot4": "dot4", "dp4a": "dot4", "exact": "dot4"}
    layouts = {}  # [batch, heads, seq, head_dim] tensors only (flash_attn_int8qk)

    def products_per_step(self, spec: KernelSpec) -> float | None:
        # dot4 over quads: S tm x (bc / tcw) over head_dim / 4; P.V tm x (head_dim / tcw) over bc / 4.
        return spec.tile.tm * spec.tile.bc * spec.head_dim / (2 * threads_per_row(spec))
    # Against the oracle on the dequantized inputs (per-token Q, K and per-channel V scales); prefill
    # shapes: more query rows per K/V head than the i8dec family takes.
    oracle_cases = {
        "plain": OracleCase(1, 2, 2, 64, 64),
        "causal_gqa": OracleCase(1, 4, 2, 70, 70, {"is_causal": True}),
        "cross": OracleCase(1, 2, 2, 33, 120, {"is_causal": True}),
        "window_scale": OracleCase(1, 2, 2, 60, 60, {"window_size": (21, 9), "softmax_scale": 0.05}),
    }

    def tier(self, target: Target) -> str | None:
        return None if target.int8_dot == "none" else target.int8_dot

    def spec(self, target: Target, point: dict, tile: Tile) -> KernelSpec:
        return KernelSpec(family=self.name, head_dim=point["head_dim"], gqa_group=point["gqa_group"], tile=tile,
                          wave_size=target.wave_size, tier=self.tier(target), stage="i8")

    def from_name(self, name: str) -> KernelSpec | None:
        v = self.schema.parse(name)
        if v is None:
            return None
        return KernelSpec(family=self.name, head_dim=v["head_dim"], gqa_group=v["gqa_group"],
                          tile=Tile.from_name_fields(v),
                          wave_size=v["wave_size"], tier=v["tier"], stage="i8")

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        return runtime.lds_layout(spec.head_dim, spec.tile.br, spec.tile.bc)

    # The main loop's schedule policy (include/pipeline.h) by int8 dot: the AMD kernels keep their
    # register budgets; sm_90 takes the prefetching schedule, and so does the host emulator, so
    # that the CPU runs the path the GPU tests run only on NVIDIA (the AMD path runs on the
    # gfx1100 emulator).
    PIPELINES = {"sdot4": "LeanPipeline", "sudot4": "LeanPipeline", "dp4a": "QuadPrefetchPipeline",
                 "exact": "QuadPrefetchPipeline"}

    def context(self, spec: KernelSpec) -> dict:
        return {"lds_bytes": self.lds_bytes(spec), "pipeline": self.PIPELINES[spec.tier]}


FAMILY = I8()
