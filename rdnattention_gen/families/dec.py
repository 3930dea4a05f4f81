"""Split-KV decode (flash-decoding): fp16 Q, K, V, fp32 softmax and products, for few query rows
per K/V head against many keys. The tile: br = tm, the query rows one workgroup holds (every
thread holds them all); bc, the keys a workgroup reads per step; threads, in lane groups of
head_dim / 8 lanes per key, rounded up to a power of two (the lanes past head_dim / 8 hold zeros).

Kernel body: templates/include/fa2_decode.h over the fp16 element policy (DecodeF16); with several
key slices, the last of a row chunk's slices to finish merges their partial outputs, in the same
launch. Also compiled for paged caches (layout ``paged``), so that the plain kernels hold no page
state."""

from __future__ import annotations

from rdnattention.families import dec as runtime

from ..family import Family, HeadDimAxis, OracleCase, Rule
from ..spec import KernelSpec, Tile
from ..target import Target, register_budgets
from .f16 import F16, LDS_RULE, REGISTER_BUDGET, WHOLE_WAVES, dtype_tier, pairs_type


# Waves per SIMD a kernel is compiled to keep resident (its register budget): a memory-bound loop
# hides latency with waves, not with registers. Kernels of one or two rows: 4 (at most 128
# registers on sm_90), measured best on the H200 (tuning/results/h200_decode.md); four rows hold
# each row's query and output in registers too: 3 (they spill at 4). A tile's `waves` overrides. GCN's wave64 SIMDs hold a
# quarter of RDNA's registers per lane: 2 there (128 VGPRs) rather than 64 VGPRs and spills.
def waves_per_simd(spec: KernelSpec) -> int:
    if spec.tile.waves:  # the tile's own budget
        return spec.tile.waves
    if spec.wave_size == 64:
        return 2
    return 4 if spec.tile.br <= 2 else 3


def key_lanes(head_dim: int, lane_values: int) -> int:
    """Lanes that share a key: head_dim / lane_values (16 bytes a lane), rounded up to a power of two
    (include/fa2_decode.h: the lanes past head_dim / lane_values hold zeros)."""
    lanes = 1
    while lanes * lane_values < head_dim:
        lanes *= 2
    return lanes


def decode_rules(lane_values: int) -> tuple[Rule, ...]:
    """The rules of a decode kernel whose lanes hold ``lane_values`` values of each key (16 bytes)."""
    def lanes(s: KernelSpec) -> int:
        return key_lanes(s.head_dim, lane_values)

    return (
        Rule("head_dim_range",
             lambda s, t: s.head_dim % lane_values == 0 and lane_values <= s.head_dim <= lane_values * s.wave_size,
             lambda s, t: f"head_dim {s.head_dim} must be a multiple of {lane_values} up to {lane_values} * wave size "
                          f"= {lane_values * s.wave_size} (head_dim / {lane_values} lanes, rounded up to a power of "
                          "two, share each key)", stop=True),
        WHOLE_WAVES,
        REGISTER_BUDGET,
        Rule("rows_per_thread",
             lambda s, t: s.tile.tm == s.tile.br,
             lambda s, t: f"tm {s.tile.tm} must equal br {s.tile.br}: every thread holds all of the workgroup's rows"),
        Rule("rows_per_key_lanes",
             lambda s, t: s.tile.br & (s.tile.br - 1) == 0 and s.tile.br <= lanes(s),
             lambda s, t: f"br {s.tile.br} must be a power of two, at most the lanes that share a key "
                          f"(head_dim / {lane_values}, rounded up to a power of two: {lanes(s)}): each lane's share of "
                          "the rows' scores is reduced by halving"),
        Rule("keys_per_group",
             lambda s, t: s.tile.threads % lanes(s) == 0 and s.tile.bc % (s.tile.threads // lanes(s)) == 0,
             lambda s, t: f"bc {s.tile.bc} must be a multiple of the lane groups threads / {lanes(s)} lanes "
                          f"= {s.tile.threads // lanes(s)}"),
        LDS_RULE,
    )


RULES = decode_rules(8)


class Dec(HeadDimAxis, Family):
    name = "dec"
    template = "fa2_dec.hip.j2"
    args = runtime.ARGS
    schema = runtime.NAMES
    rules = RULES
    signatures = F16.signatures
    layouts = runtime.LAYOUTS  # paged: a paged cache (block_table)
    dtypes = runtime.DTYPES    # bf16 (F16's docstring: the same element policy per value)
    lane_values = 8  # fp16 values of each key per lane (16 bytes)
    # Decode rows: at most 8 query rows per K/V head (route.SPLIT_KV_MAX_ROWS), against many keys.
    oracle_cases = {
        "decode": OracleCase(2, 4, 2, 1, 203),
        "rows_causal": OracleCase(1, 6, 2, 2, 150, {"is_causal": True}),
        "window": OracleCase(1, 2, 1, 4, 120, {"window_size": (16, 3)}),
        "lengths": OracleCase(3, 4, 2, 1, 200, {"seqused_k": (200, 1, 77)}),
        # A page pool in shuffled page order; seq_k: pages per sequence x page_size.
        "paged": OracleCase(2, 4, 2, 1, 256, {"page_size": 16, "seqused_k": (256, 100)}, layout="paged"),
        "paged_causal": OracleCase(2, 4, 2, 3, 128, {"page_size": 64, "is_causal": True, "seqused_k": (128, 70)},
                                   layout="paged"),
        # Score transforms: each row's sink joins where it is written (one slice).
        "decode_score": OracleCase(2, 8, 2, 1, 203, {"softcap": 3.0, "alibi": "batch", "sinks": True,
                                                     "num_splits": 1}),
        "window_alibi_sinks": OracleCase(1, 2, 1, 4, 120, {"window_size": (16, 3), "alibi": "heads", "sinks": True}),
        # ALiBi runs these kernels whatever the rows (tiles of at most two rows, in chunks) where no
        # row-block kernel of score option alibi is built for the head_dim, or the call asks for key
        # slices (num_splits, as here, so that every head_dim runs them): a prefill.
        "alibi_prefill_gqa": OracleCase(2, 4, 2, 37, 110, {"is_causal": True, "alibi": "batch", "softcap": 3.0,
                                                           "sinks": True, "num_splits": 2}),
        "alibi_lengths": OracleCase(2, 2, 2, 20, 90, {"window_size": (30, 0), "seqused_k": (90, 41),
                                                      "alibi": "heads", "num_splits": 2}),
        "paged_score": OracleCase(2, 4, 2, 3, 128, {"page_size": 64, "is_causal": True, "seqused_k": (128, 70),
                                                    "softcap": 3.0, "alibi": "batch", "sinks": True}, layout="paged"),
    }

    def tier(self, target: Target) -> str | None:
        return target.tier.value

    def stage(self, target: Target) -> str:
        return target.stage

    def spec(self, target: Target, point: dict, tile: Tile) -> KernelSpec:
        tier, stage = self.tier(target), self.stage(target)
        if point.get("dtype"):
            tier, stage = dtype_tier(target, point["dtype"], tier)
        return KernelSpec(family=self.name, head_dim=point["head_dim"], gqa_group=1, tile=tile,
                          wave_size=target.wave_size, tier=tier, stage=stage, options=self.options(point))

    def from_name(self, name: str) -> KernelSpec | None:
        v = self.schema.parse(name)
        if v is None:
            return None
        return KernelSpec(family=self.name, head_dim=v["head_dim"], gqa_group=v["gqa_group"],
                          tile=Tile.from_name_fields(v), wave_size=v["wave_size"], tier=v["tier"],
                          stage=v.get("stage", "i8"),
                          options=self.options({"layout": v.get("options.layout"), "dtype": v.get("options.dtype")}))

    def tile_space(self, target: Target, head_dim: int) -> dict[str, tuple[int, ...]] | None:
        """1, 2, 4 or 8 rows per workgroup, 1-8 keys per lane group per step, 128 threads, and
        register budgets of 80-255 registers: a memory stream hides latency with waves more than
        with registers (tuning/results/h200_decode.md)."""
        groups = max(1, 128 // key_lanes(head_dim, self.lane_values))
        return {"br": (1, 2, 4, 8), "tm": (1, 2, 4, 8), "bc": tuple(groups * t for t in (1, 2, 4, 8)), "threads": (128,),
                "waves": (0,) + register_budgets(target, lowest=80)}

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        return runtime.lds_layout(spec.head_dim, spec.tile.threads, spec.tile.br, spec.wave_size)

    def context(self, spec: KernelSpec) -> dict:
        bf16 = spec.option("dtype") == "bf16"
        return {"pairs": pairs_type(spec), "lds_bytes": self.lds_bytes(spec), "waves": waves_per_simd(spec),
                "paged": spec.option("layout") == "paged", "element": "DecodeBF16" if bf16 else "DecodeF16"}


FAMILY = Dec()
