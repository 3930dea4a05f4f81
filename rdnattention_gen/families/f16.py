"""fp16 FlashAttention-2 forward: fp16 Q, K, V and output; both products and the softmax in fp32.

bf16 is a dtype option of the family (``dtypes:`` under it in variants.yaml, like ``layouts:``): the
same kernel body, tiles and layouts over a bf16 element policy (pairs.h), built at the head_dims
the bf16 checkpoints use rather than at all of them, so the matrix grows by a few kernels per
target, not twofold. No target multiplies bf16 pairs natively in this build: every value is
widened to fp32 by a 16-bit shift (tier ``shift_fma``), where LDS holds fp32 pairs (stage f32:
sm_90, host_f32) once when its tile is staged, elsewhere (stage bf16: the AMD targets, the host)
where it is read from LDS, so that LDS holds 16-bit pairs as for fp16 and every tile fits as it
does for fp16. The probabilities are rounded to bf16 for P.V where LDS holds bf16 pairs, as
flash-attn rounds them to the input dtype.

Kernel body: templates/include/fa2_f16.h (the fp16 element policy over fa2_forward.h), composed
from the policies in fa2_policies.h and a schedule policy of pipeline.h."""

from __future__ import annotations

from rdnattention.families import f16 as runtime

from ..family import Family, OracleCase, Rule
from ..spec import KernelSpec, Tile
from ..strict_yaml import Node
from ..target import Target


def thread_grid(spec: KernelSpec) -> dict[str, int]:
    """Thread rows, threads per row, keys and output columns per thread (TRW, TCW, TN, TD)."""
    t = spec.tile
    trw = t.br // t.tm if t.tm else 0
    tcw = t.threads // trw if trw else 0
    return {"trw": trw, "tcw": tcw, "tn": t.bc // tcw if tcw else 0, "td": spec.head_dim // tcw if tcw else 0}


def threads_per_row(spec: KernelSpec) -> int:
    return thread_grid(spec)["tcw"]


def padded_head_dim(spec: KernelSpec) -> int:
    """The head_dim the kernel's tiles hold (the runtime's padded_head_dim): zero columns up to a
    multiple of 2 * threads per row."""
    return runtime.padded_head_dim(spec.head_dim, spec.tile.br, spec.tile.threads, spec.tile.tm)


# Every family's workgroups are whole waves.
WHOLE_WAVES = Rule("whole_waves",
                   lambda s, t: s.tile.threads % s.wave_size == 0,
                   lambda s, t: f"threads {s.tile.threads} must be a multiple of the wave size {s.wave_size}")

# A tile's register budget (waves per SIMD) must be one the target's SIMDs can hold.
REGISTER_BUDGET = Rule("register_budget",
                       lambda s, t: 0 <= s.tile.waves <= t.max_waves_per_simd,
                       lambda s, t: f"waves {s.tile.waves} must be at most the target's {t.max_waves_per_simd} waves per SIMD")

# The thread-grid rules every fa2 family shares; a family adds its head_dim and key rules.
GRID_RULES = (
    REGISTER_BUDGET,
    Rule("group_divides_rows",
         lambda s, t: s.gqa_group >= 1 and s.tile.br % s.gqa_group == 0,
         lambda s, t: f"br {s.tile.br} must be a multiple of the GQA group {s.gqa_group}"),
    WHOLE_WAVES,
    Rule("thread_grid",
         lambda s, t: s.tile.tm <= s.tile.br and s.tile.br % s.tile.tm == 0 and s.tile.threads % (s.tile.br // s.tile.tm) == 0,
         lambda s, t: f"threads {s.tile.threads} must be a multiple of br/tm = {s.tile.br / s.tile.tm:g}",
         stop=True),
    Rule("row_lanes",
         lambda s, t: threads_per_row(s) & (threads_per_row(s) - 1) == 0 and threads_per_row(s) <= s.wave_size,
         lambda s, t: f"threads per row (threads*tm/br = {threads_per_row(s)}) must be a power of two no larger than "
                      f"the wave size {s.wave_size}"),
)
COLUMNS_RULE = Rule("columns_per_lane",
                    lambda s, t: s.head_dim % (2 * threads_per_row(s)) == 0,
                    lambda s, t: f"head_dim {s.head_dim} must be a multiple of 2 * threads per row = {2 * threads_per_row(s)}")
# fp16 kernels pad the head_dim with zero columns to a multiple of 2 * threads per row instead, in
# LDS and registers only: at most a quarter of the columns they compute may be padding.
PADDING_RULE = Rule("padding",
                    lambda s, t: 4 * (padded_head_dim(s) - s.head_dim) <= s.head_dim,
                    lambda s, t: f"head_dim {s.head_dim} padded to a multiple of 2 * threads per row = "
                                 f"{2 * threads_per_row(s)} is {padded_head_dim(s)}: more than a quarter of its "
                                 "columns would be padding")
LDS_RULE = Rule("lds_budget",
                lambda s, t: s.lds_bytes <= t.lds_bytes,
                lambda s, t: f"needs {s.lds_bytes} bytes of LDS, over the {t.lds_bytes} budget")

def head_dim_in_range(head_dim: int) -> bool:
    """The head_dims the fp16 row-block kernels are written for: every multiple of 8 up to 256 (a row
    is whole 16-byte chunks), beyond that multiples of 32 up to 512."""
    return 8 <= head_dim <= 512 and head_dim % (8 if head_dim <= 256 else 32) == 0


RULES = (
    Rule("head_dim_range",
         lambda s, t: head_dim_in_range(s.head_dim),
         lambda s, t: f"head_dim {s.head_dim} must be a multiple of 8 in 8..256 or of 32 in 288..512"),
    *GRID_RULES,
    Rule("keys_per_lane",
         lambda s, t: s.tile.bc % (2 * threads_per_row(s)) == 0,
         lambda s, t: f"bc {s.tile.bc} must be a multiple of 2 * threads per row = {2 * threads_per_row(s)}"),
    PADDING_RULE,
    LDS_RULE,
)


class F16(Family):
    name = "f16"
    template = "fa2_f16.hip.j2"
    args = runtime.ARGS
    schema = runtime.NAMES
    rules = RULES
    # The instruction each tier's kernels must contain (audit counts).
    signatures = {"dot2": "dot2", "fma_mix": "fma_mix", "mad_mix": "mad_mix", "cvt_fma": "cvt_f32_f16",
                  "shift_fma": "none",  # a shift and fp32 FMAs: no instruction of its own to find
                  "bf16_dot2": "dot2"}  # v_dot2_f32_bf16 (the audit's dot2 count takes every v_dot2)
    layouts = runtime.LAYOUTS  # len: cache lengths (seqused_k); varlen: packed batches
    dtypes = runtime.DTYPES    # bf16
    scores = runtime.SCORES    # xf (softcap, sinks), alibi
    oracle_cases = {
        "plain": OracleCase(2, 2, 2, 100, 100),
        "causal": OracleCase(1, 2, 2, 150, 150, {"is_causal": True}),
        "window_left": OracleCase(1, 2, 2, 150, 150, {"is_causal": True, "window_size": (37, -1)}),
        "window_two_sided": OracleCase(1, 2, 2, 140, 140, {"window_size": (21, 9)}),
        "gqa": OracleCase(1, 4, 2, 97, 97, {"is_causal": True}),
        "mqa": OracleCase(1, 3, 1, 80, 80),
        "cross": OracleCase(1, 2, 2, 45, 170, {"is_causal": True}),
        # Few rows against many keys: the fewest query rows per sequence the row-block kernels serve
        # (route.SPLIT_KV_MAX_SEQ_Q + 1; fewer go to the dec family), in a partial row block.
        "few_rows": OracleCase(2, 2, 1, 17, 203),
        "rope": OracleCase(1, 4, 2, 90, 90, {"is_causal": True, "rope": True}),
        # Cache lengths: enough query rows per K/V head for the row-block kernels; a used length
        # of 0 is an empty row.
        "lengths": OracleCase(3, 2, 2, 17, 100, {"seqused_k": (100, 37, 0)}, layout="len"),
        "lengths_causal_gqa": OracleCase(2, 4, 2, 24, 90, {"is_causal": True, "seqused_k": (90, 30)}, layout="len"),
        "lengths_window": OracleCase(2, 2, 2, 20, 80, {"window_size": (16, 3), "seqused_k": (80, 41)},
                                     layout="len"),
        # Packed batches (batch, seq_q, seq_k: the count and the longest of the lengths).
        "packed": OracleCase(3, 2, 2, 30, 60, {"seqlens_q": (30, 1, 17), "seqlens_k": (30, 60, 17)},
                             layout="varlen"),
        "packed_causal_gqa": OracleCase(2, 4, 2, 20, 50, {"is_causal": True, "seqlens_q": (20, 9),
                                                          "seqlens_k": (50, 9)}, layout="varlen"),
        "packed_window": OracleCase(2, 2, 2, 40, 70, {"window_size": (21, 9), "seqlens_q": (12, 40),
                                                      "seqlens_k": (70, 40)}, layout="varlen"),
        # Score transforms (a softcap low enough to bend the scores; sinks), with masks, GQA and rows
        # that see no key (a sink's LSE): the kernels of score option xf. ALiBi runs those of score
        # option alibi (its cases below); of few rows, the dec family's kernels (route.py).
        "softcap_window": OracleCase(1, 4, 2, 120, 120, {"is_causal": True, "window_size": (40, -1), "softcap": 2.0},
                                     score="xf"),
        "sinks_cross": OracleCase(1, 4, 2, 90, 60, {"is_causal": True, "sinks": True}, score="xf"),
        "lengths_score": OracleCase(2, 4, 2, 24, 90, {"is_causal": True, "seqused_k": (90, 30), "softcap": 3.0,
                                                      "sinks": True}, layout="len", score="xf"),
        "packed_score": OracleCase(3, 4, 2, 30, 60, {"window_size": (21, 9), "seqlens_q": (30, 1, 17),
                                                     "seqlens_k": (30, 60, 17), "softcap": 3.0, "sinks": True},
                                   layout="varlen", score="xf"),
        # ALiBi (slopes per head or per batch and head) with causal masks (more keys than queries: the
        # diagonal moves), windows on both sides (distances either way), GQA, MQA, softcap and sinks,
        # cache lengths and packed batches (each sequence's own lengths and slopes).
        "alibi_causal_gqa": OracleCase(2, 4, 2, 70, 130, {"is_causal": True, "alibi": "batch"}, score="alibi"),
        "alibi_window": OracleCase(1, 2, 2, 100, 100, {"window_size": (21, 9), "alibi": "heads", "softcap": 3.0,
                                                       "sinks": True}, score="alibi"),
        "alibi_mqa": OracleCase(1, 3, 1, 80, 60, {"alibi": "heads"}, score="alibi"),
        "lengths_alibi": OracleCase(2, 4, 2, 24, 90, {"is_causal": True, "seqused_k": (90, 30), "alibi": "batch"},
                                    layout="len", score="alibi"),
        "packed_alibi": OracleCase(3, 4, 2, 30, 60, {"is_causal": True, "seqlens_q": (30, 1, 17),
                                                     "seqlens_k": (30, 60, 17), "alibi": "batch", "sinks": True},
                                   layout="varlen", score="alibi"),
    }

    def axes(self, node: Node) -> dict:
        axes = {"head_dims": node.int_list("head_dims"), "gqa_groups": node.int_list("gqa_groups")}
        axes.update(self.layout_axes(node, axes["head_dims"]))
        axes.update(self.dtype_axes(node, axes["head_dims"]))
        axes.update(self.score_axes(node, axes["head_dims"]))
        node.finish()
        return axes

    def plain_points(self, axes: dict) -> list[dict]:
        return [{"head_dim": hd, "gqa_group": g} for hd in axes["head_dims"] for g in axes["gqa_groups"]]

    def tier(self, target: Target) -> str | None:
        return target.tier.value  # every target multiplies fp16 pairs, natively or not

    def spec(self, target: Target, point: dict, tile: Tile) -> KernelSpec:
        tier, stage = dtype_tier(target, point.get("dtype"), self.tier(target))
        return KernelSpec(family=self.name, head_dim=point["head_dim"], gqa_group=point["gqa_group"], tile=tile,
                          wave_size=target.wave_size, tier=tier, stage=stage, options=self.options(point))

    def from_name(self, name: str) -> KernelSpec | None:
        v = self.schema.parse(name)
        if v is None:
            return None
        return KernelSpec(family=self.name, head_dim=v["head_dim"], gqa_group=v["gqa_group"],
                          tile=Tile.from_name_fields(v),
                          wave_size=v["wave_size"], tier=v["tier"], stage=v["stage"],
                          options=self.options({"layout": v.get("options.layout"), "dtype": v.get("options.dtype"),
                                               "score": v.get("options.score")}))

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        return runtime.lds_layout(padded_head_dim(spec), spec.tile.br, spec.tile.bc, spec.stage)

    def tile_space(self, target: Target, head_dim: int) -> dict[str, tuple[int, ...]] | None:
        return {"br": (32, 64, 128), "bc": (16, 32, 64), "threads": (128, 256), "tm": (2, 4, 8)}

    # Signature instructions per pair product: dot2 does one, the mixed FMAs take two (one per half).
    PER_PAIR = {"dot2": 1, "fma_mix": 2, "mad_mix": 2, "bf16_dot2": 1}

    def products_per_step(self, spec: KernelSpec) -> float | None:
        per_pair = self.PER_PAIR.get(spec.tier)
        if per_pair is None:
            return None  # cvt_fma: the converts are the signature, not one per product
        # S: tm x (bc / tcw) over head_dim / 2 pairs; P.V: tm x (head_dim / tcw) over bc / 2 pairs, the
        # padded head_dim's.
        return per_pair * spec.tile.tm * spec.tile.bc * padded_head_dim(spec) / threads_per_row(spec)

    # The main loop's schedule policy (include/pipeline.h) by staging precision: fp32 pairs are
    # sm_90's (and host_f32's, which mirrors it), fp16 pairs the AMD targets' (and the host's). The
    # runtime's lds_layout sizes the P tile's row-pair gap by the same rule.
    PIPELINES = {"f16": "LeanPipeline", "bf16": "LeanPipeline", "f32": "PrefetchPipeline"}

    def context(self, spec: KernelSpec) -> dict:
        return {"pairs": pairs_type(spec), "pipeline": self.PIPELINES[spec.stage],
                "lds_bytes": self.lds_bytes(spec), "padded_head_dim": padded_head_dim(spec),
                "lengths": spec.option("layout") == "len", "varlen": spec.option("layout") == "varlen",
                "bf16": spec.option("dtype") == "bf16", "score": SCORE_CODES[spec.option("score")]}


# fa2_f16_forward's SCORE argument by score option (fa2_f16.h): none, softcap and sinks, and ALiBi too.
SCORE_CODES = {None: 0, "xf": 1, "alibi": 2}


# bf16 pairs multiplied by v_dot2_f32_bf16 (targets with bf16_dot), LDS holding them as loaded.
BF16_DOT2 = "bf16_dot2"
# The pair types of pairs.h, by input dtype and staging precision (and BF16DotPairs: tier bf16_dot2).
PAIRS = {(None, "f16"): "F16Pairs", (None, "f32"): "F32Pairs", ("bf16", "bf16"): "BF16Pairs",
         ("bf16", "f32"): "BF16F32Pairs"}


def pairs_type(spec: KernelSpec) -> str:
    if spec.tier == BF16_DOT2:
        return "BF16DotPairs"
    return PAIRS[spec.option("dtype"), spec.stage]


def dtype_tier(target: Target, dtype: str | None, fp16_tier: str) -> tuple[str, str]:
    """A kernel's (tier, stage) for input ``dtype`` on ``target``: fp16 (None) takes the target's
    tier and staging; bf16 pairs go to the target's bf16 dot where it has one (bf16_dot2, gfx11+),
    else are widened by a shift (shift_fma), into fp32 pairs when staged where the target stages
    fp32, else kept as bf16 pairs in LDS."""
    if dtype is None:
        return fp16_tier, target.stage
    if target.stage == "f32":
        return "shift_fma", "f32"
    return (BF16_DOT2 if target.bf16_dot else "shift_fma"), "bf16"


FAMILY = F16()
