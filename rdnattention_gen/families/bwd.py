"""FlashAttention-2 backward: dQ, dK and dV from fp16 (or bf16) Q, K, V, O, dO and the forward's
log-sum-exp, accumulated in fp32. The products take values staged in LDS either as fp32, each
converted once (fp16: cvt_fma, bf16: shift_fma), or as loaded (stage): fp16 on the targets whose
tier multiplies fp16 without converting first (dot2, fma_mix), bf16 on those with a bf16 dot
(bf16_dot2), the host standing for both. The score products take 16-bit pairs (the tier's), the
gradients' a 16-bit value beside an fp32 weight. Three passes, each a kernel (the family's layout option: pre, the
plain dK/dV kernels, dq; rdnattention/families/bwd.py), every gradient summed in one fixed order:
deterministic, with no atomics. Or, with one recomputation fewer, pre, atomic (dK/dV, and dQ added
into an fp32 sum by atomics) and dqcast (that sum to the input dtype).

Kernel body: templates/include/fa2_backward.h. It is not a forward family: the oracle sweep of the
forward (tests/kernels/test_oracle_sweep.py) leaves it to tests/kernels/test_backward.py, which
checks every built backward kernel's gradients against the float64 oracle's."""

from __future__ import annotations

from rdnattention.families import bwd as runtime

from ..family import Family, HeadDimAxis, Rule
from ..spec import KernelSpec, Tile
from ..target import Target
from .f16 import LDS_RULE, REGISTER_BUDGET, WHOLE_WAVES


def micro_tiles(head_dim: int, br: int, bc: int, threads: int, layout: str | None) -> tuple[int, int, int] | None:
    """Each thread's register tiles in a pass (fa2_backward.h): (TM, TN, CG), TM x TN scores of a
    (br / TM) x (bc / TN) thread grid, and CG lanes across a gradient row of head_dim / 4 16-byte
    chunks, the threads / CG others each owning TK consecutive gradient rows (of bc keys in the dK/dV
    pass, of br query rows in dQ's). The preprocess pass has none: (1, 1, 1). None: the tile has no
    such grid. Chosen for the fewest LDS reads per FMA (the squarest score tile; the gradient tile
    of most FMAs per read, then the most lanes across a row).

    A tile of fewer scores than threads gives one score to each of the first br * bc lanes, and
    one whose gradient rows cannot be shared out evenly gives a row (TK = 1) to each of the first
    rows x CG lanes, for the largest CG there is: the other lanes wait at the phase's barrier. A
    workgroup of four waves, some idle in a phase, still keeps every SIMD of a GCN CU busy in the
    others where the 64 KiB of LDS holds one workgroup (a tile of whole phases for all four waves
    does not fit there at head_dim 80 or 256)."""
    if layout in ("pre", "dqcast"):
        return (1, 1, 1)
    if br % 4 or bc % 4 or head_dim % 4 or (br * bc >= threads and br * bc % threads):
        return None
    area = max(br * bc // threads, 1)
    scores = [(tm + area // tm, tm) for tm in range(1, area + 1)
              if area % tm == 0 and br % tm == 0 and bc % (area // tm) == 0]
    # The gradient rows: query rows (dq), keys (dK/dV), both (atomic: its dQ rows share the grid).
    outs, chunks = (br if layout == "dq" else bc), head_dim // 4
    grads, idle = [], []
    for cg in range(1, chunks + 1):
        if chunks % cg or threads % cg:
            continue
        if layout == "atomic" and br % (threads // cg) and threads // cg <= br:
            continue
        if outs % (threads // cg) == 0:
            tk, nch = outs // (threads // cg), chunks // cg
            grads.append((4 * tk * nch / (-(-tk // 4) + nch), cg))
        elif threads // cg > outs:
            idle.append((cg, cg))
    grads = grads or idle
    if not scores or not grads:
        return None
    tm = min(scores)[1]
    return (tm, area // tm, max(grads)[1])


RULES = (
    Rule("head_dim_range",
         lambda s, t: 16 <= s.head_dim <= 256 and s.head_dim % 8 == 0,
         lambda s, t: f"head_dim {s.head_dim} must be a multiple of 8 in 16..256"),
    REGISTER_BUDGET,
    WHOLE_WAVES,
    Rule("rows_per_workgroup",
         lambda s, t: s.tile.threads % s.tile.br == 0,
         lambda s, t: f"threads {s.tile.threads} must be a multiple of br {s.tile.br} (the preprocess pass's "
                      f"lanes per row)"),
    Rule("register_tiles",
         lambda s, t: micro_tiles(s.head_dim, s.tile.br, s.tile.bc, s.tile.threads, s.option("layout")) is not None,
         lambda s, t: f"br {s.tile.br} x bc {s.tile.bc} over {s.tile.threads} threads has no register tiles: br and "
                      f"bc must be multiples of 4, br * bc a multiple of threads (or fewer) with a TM x TN score "
                      f"tile per thread (TM dividing br, TN dividing bc), and some CG dividing threads and "
                      f"head_dim / 4 = {s.head_dim / 4:g} whose threads / CG row groups divide the gradient's "
                      f"{s.tile.br if s.option('layout') == 'dq' else s.tile.bc} rows (or outnumber them)"),
    LDS_RULE,
)

# A kernel's tier by (preprocess pass, dtype option): the dK/dV and dQ passes convert fp16 once when
# staged (cvt_fma) or widen bf16 by a shift (shift_fma); the preprocess pass's products of O and dO
# are fp32 sums whatever the lowering (fp32).
TIERS = {(False, None): "cvt_fma", (False, "bf16"): "shift_fma", (True, None): "fp32", (True, "bf16"): "fp32"}

# The pair policy (pairs.h) by (staging, tier): fp32 rows widened from each input dtype when staged,
# or 16-bit rows as loaded, multiplied by the tier's pair product.
PAIRS = {("f32", None): "F32Pairs", ("f32", "bf16"): "BF16F32Pairs", ("f16", None): "F16Pairs",
         ("bf16", "bf16_dot2"): "BF16DotPairs", ("bf16", "shift_fma"): "BF16Pairs"}

# fp16 tiers whose products take fp16 values without a convert instruction: v_dot2_f32_f16 for a
# pair, v_fma_mix_f32 for an fp16 value times an fp32 one (the compiler fuses the conversion).
FUSED_TIERS = ("dot2", "fma_mix")


def row_stage(target: Target, layout: str | None, dtype: str | None) -> tuple[str, str] | None:
    """(stage, tier) of a pass whose rows stay 16-bit in LDS, as loaded, or None where they are
    widened to fp32 when staged. Only the passes that stage rows (not pre or dqcast) on targets
    that stage 16-bit pairs for the forward: fp16 where the tier multiplies fp16 without converting
    (FUSED_TIERS), bf16 where the target has a bf16 dot; the host emulator (which has neither)
    stands for both with the portable products."""
    if layout in ("pre", "dqcast") or target.stage != "f16":
        return None
    host = target.platform == "host"
    if dtype is None and (host or target.tier.value in FUSED_TIERS):
        return ("f16", target.tier.value)
    if dtype == "bf16" and (host or target.bf16_dot):
        return ("bf16", "bf16_dot2" if target.bf16_dot else "shift_fma")
    return None


class Backward(HeadDimAxis, Family):
    name = "bwd"
    template = "fa2_bwd.hip.j2"
    args = runtime.ARGS
    schema = runtime.NAMES
    rules = RULES
    # fp16: a convert per staged value; bf16: a shift, no instruction of its own to find; the
    # preprocess pass: one product per value read, which the compiler may lower to a mixed FMA.
    # 16-bit rows: the score products' v_dot2 (dot2, bf16_dot2) or v_fma_mix (fma_mix).
    signatures = {"cvt_fma": "cvt_f32_f16", "shift_fma": "none", "fp32": "none", "dot2": "dot2",
                  "fma_mix": "fma_mix", "bf16_dot2": "dot2"}
    dtypes = runtime.DTYPES
    layouts = runtime.LAYOUTS  # the passes: pre, dq, atomic, dqcast; the plain kernels are the dK/dV pass
    backward = True  # swept by tests/kernels/test_backward.py, not by the forward's oracle sweep
    oracle_cases = {}  # the gradient cases live in tests/kernels/test_backward.py
    tile_constraints = False  # one kernel per head_dim and dtype serves every call
    tune_layouts = True  # a tile's passes are built and timed together (tune._BwdHarness)

    def tier(self, target: Target) -> str | None:
        return "cvt_fma"

    def tile_space(self, target: Target, head_dim: int) -> dict[str, tuple[int, ...]] | None:
        return {"br": (16, 32, 64), "bc": (16, 32, 64), "threads": (128, 256, 512), "tm": (1,)}

    def builds_point(self, target: Target, point: dict) -> bool:
        """The atomic passes where the target adds floats in memory (Target.adds_floats_in_memory)."""
        return point.get("layout") not in ("atomic", "dqcast") or target.adds_floats_in_memory

    def _spec(self, head_dim: int, tile: Tile, wave_size: int, layout: str | None, dtype: str | None,
              rows: tuple[str, str] | None = None) -> KernelSpec:
        """``rows``: (stage, tier) of a pass that keeps 16-bit rows (row_stage), None for fp32 rows."""
        stage, tier = rows or ("f32", TIERS[layout in ("pre", "dqcast"), dtype])
        options = self.options({"layout": layout, "dtype": dtype}) + ((("stage", stage),) if rows else ())
        return KernelSpec(family=self.name, head_dim=head_dim, gqa_group=1,
                          tile=Tile(br=tile.br, bc=tile.bc, threads=tile.threads, tm=1, waves=tile.waves),
                          wave_size=wave_size, tier=tier, stage=stage, options=options)

    def sibling(self, spec: KernelSpec, layout: str | None) -> KernelSpec:
        """The kernel of pass ``layout`` in ``spec``'s set: its tile, dtype and staging."""
        rows = (spec.stage, spec.tier) if spec.stage != "f32" and layout not in ("pre", "dqcast") else None
        return self._spec(spec.head_dim, spec.tile, spec.wave_size, layout, spec.option("dtype"), rows)

    def spec(self, target: Target, point: dict, tile: Tile) -> KernelSpec:
        layout, dtype = point.get("layout"), point.get("dtype")
        return self._spec(point["head_dim"], tile, target.wave_size, layout, dtype, row_stage(target, layout, dtype))

    def from_name(self, name: str) -> KernelSpec | None:
        v = self.schema.parse(name)
        if v is None:
            return None
        tile = Tile(br=v["tile.br"], bc=v["tile.bc"], threads=v["tile.threads"], tm=1, waves=v.get("tile.waves", 0))
        stage = v.get("options.stage")
        return self._spec(v["head_dim"], tile, v["wave_size"], v.get("options.layout"), v.get("options.dtype"),
                          (stage, v["tier"]) if stage else None)

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        return runtime.lds_layout(spec.head_dim, spec.tile.br, spec.tile.bc, spec.tile.threads, spec.option("layout"),
                                  spec.stage)

    def context(self, spec: KernelSpec) -> dict:
        tm, tn, cg = micro_tiles(spec.head_dim, spec.tile.br, spec.tile.bc, spec.tile.threads, spec.option("layout"))
        pairs = PAIRS[spec.stage, spec.option("dtype") if spec.stage == "f32" else None if spec.stage == "f16"
                      else spec.tier]
        return {"pairs": pairs, "lds_bytes": self.lds_bytes(spec), "bf16": spec.option("dtype") == "bf16",
                "pass_": runtime.PASSES[spec.option("layout")],
                "tm": tm, "tn": tn, "cg": cg}


FAMILY = Backward()
