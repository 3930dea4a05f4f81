"""FlashAttention-2 backward: dQ, dK and dV from fp16 (or bf16) Q, K, V, O, dO and the forward's
log-sum-exp, every product an fp32 FMA on values converted once when staged (fp16: cvt_fma, bf16:
shift_fma), accumulated in fp32. Three passes, each a kernel (the family's layout option: pre, the
plain dK/dV kernels, dq; rdnattention/families/bwd.py), every gradient summed in one fixed order:
deterministic, with no atomics.

Kernel body: templates/include/fa2_backward.h. It is not a forward family: the oracle sweep of the
forward (tests/kernels/test_oracle_sweep.py) leaves it to tests/kernels/test_backward.py, which
checks every built backward kernel's gradients against the float64 oracle's."""

from __future__ import annotations

from rdnattention.families import bwd as runtime

from ..family import Family, HeadDimAxis, Rule
from ..spec import KernelSpec, Tile
from ..target import Target
from .f16 import LDS_RULE, REGISTER_BUDGET, WHOLE_WAVES

RULES = (
    Rule("head_dim_range",
         lambda s, t: 16 <= s.head_dim <= 256 and s.head_dim % 8 == 0,
         lambda s, t: f"head_dim {s.head_dim} must be a multiple of 8 in 16..256"),
    REGISTER_BUDGET,
    WHOLE_WAVES,
    Rule("lanes_per_row",
         lambda s, t: s.tile.threads % s.tile.bc == 0 and s.tile.threads % s.tile.br == 0
                      and s.head_dim % (2 * (s.tile.threads // s.tile.bc)) == 0
                      and s.head_dim % (2 * (s.tile.threads // s.tile.br)) == 0,
         lambda s, t: f"threads {s.tile.threads} must be a multiple of br {s.tile.br} and bc {s.tile.bc}, and "
                      f"head_dim {s.head_dim} of twice threads/br and threads/bc (each lane owns column pairs)"),
    LDS_RULE,
)

# A kernel's tier by (preprocess pass, dtype option): the dK/dV and dQ passes convert fp16 once when
# staged (cvt_fma) or widen bf16 by a shift (shift_fma); the preprocess pass's products of O and dO
# are fp32 sums whatever the lowering (fp32).
TIERS = {(False, None): "cvt_fma", (False, "bf16"): "shift_fma", (True, None): "fp32", (True, "bf16"): "fp32"}

# The pair policy (pairs.h) that widens each input dtype to fp32 when staged.
PAIRS = {None: "F32Pairs", "bf16": "BF16F32Pairs"}


class Backward(HeadDimAxis, Family):
    name = "bwd"
    template = "fa2_bwd.hip.j2"
    args = runtime.ARGS
    schema = runtime.NAMES
    rules = RULES
    # fp16: a convert per staged value; bf16: a shift, no instruction of its own to find; the
    # preprocess pass: one product per value read, which the compiler may lower to a mixed FMA.
    signatures = {"cvt_fma": "cvt_f32_f16", "shift_fma": "none", "fp32": "none"}
    dtypes = runtime.DTYPES
    layouts = runtime.LAYOUTS  # the passes: pre and dq; the plain kernels are the dK/dV pass
    backward = True  # swept by tests/kernels/test_backward.py, not by the forward's oracle sweep
    oracle_cases = {}  # the gradient cases live in tests/kernels/test_backward.py
    tile_constraints = False  # one kernel per head_dim and dtype serves every call

    def tier(self, target: Target) -> str | None:
        return "cvt_fma"

    def _spec(self, head_dim: int, tile: Tile, wave_size: int, layout: str | None, dtype: str | None) -> KernelSpec:
        return KernelSpec(family=self.name, head_dim=head_dim, gqa_group=1,
                          tile=Tile(br=tile.br, bc=tile.bc, threads=tile.threads, tm=1, waves=tile.waves),
                          wave_size=wave_size, tier=TIERS[layout == "pre", dtype], stage="f32",
                          options=self.options({"layout": layout, "dtype": dtype}))

    def spec(self, target: Target, point: dict, tile: Tile) -> KernelSpec:
        return self._spec(point["head_dim"], tile, target.wave_size, point.get("layout"), point.get("dtype"))

    def from_name(self, name: str) -> KernelSpec | None:
        v = self.schema.parse(name)
        if v is None:
            return None
        tile = Tile(br=v["tile.br"], bc=v["tile.bc"], threads=v["tile.threads"], tm=1, waves=v.get("tile.waves", 0))
        return self._spec(v["head_dim"], tile, v["wave_size"], v.get("options.layout"), v.get("options.dtype"))

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        return runtime.lds_layout(spec.head_dim, spec.tile.br, spec.tile.bc, spec.tile.threads, spec.option("layout"))

    def context(self, spec: KernelSpec) -> dict:
        return {"pairs": PAIRS[spec.option("dtype")], "lds_bytes": self.lds_bytes(spec),
                "bf16": spec.option("dtype") == "bf16", "pass_": runtime.PASSES[spec.option("layout")]}


FAMILY = Backward()
