"""The append step of flash_attn_with_kvcache: the new keys and values written into the cache (k
rotated by RoPE), the queries rotated, the lengths after the append; no products, no LDS. One
kernel per dtype and RoPE mode (the layout options rope and ropehalf), head_dim a launch argument
up to the kernels' head_dim (runtime: rdnattention/families/append.py).

Kernel body: templates/include/fa2_append.h."""

from __future__ import annotations

from rdnattention.families import append as runtime

from ..family import Family, HeadDimAxis, OracleCase, Rule
from ..spec import KernelSpec, Tile
from ..target import Target
from .f16 import WHOLE_WAVES

RULES = (
    Rule("head_dim_max", lambda s, t: s.head_dim == runtime.HEAD_DIM_MAX,
         lambda s, t: f"head_dim {s.head_dim}: the append kernels take head_dims up to {runtime.HEAD_DIM_MAX} "
                      "at launch and are built once, at that head_dim"),
    WHOLE_WAVES,
)
ROPE = {None: 0, "rope": 1, "ropehalf": 2}


class Append(HeadDimAxis, Family):
    name = "append"
    template = "fa2_append.hip.j2"
    head_dim_at_launch = True
    args = runtime.ARGS
    schema = runtime.NAMES
    rules = RULES
    signatures = {"f64": "none"}  # float64 RoPE, no product instruction to find
    # flash_attn_with_kvcache calls that append ``append`` keys (the last of seq_k) to a cache of the
    # others, RoPE'd (``append_rope``: interleaved or not) where the layout is a RoPE mode, at the
    # head_dims below (the kernels take any at launch): tests/cases.py's _append checks the cache
    # after the append against reference.rotate and the output against the oracle on it. Byte
    # identity with the torch append: tests/kernels/test_append.py.
    oracle_cases = {
        "append": OracleCase(3, 4, 2, 1, 40, {"append": 1}),
        "append_prefill": OracleCase(2, 4, 2, 5, 40, {"append": 5, "is_causal": True}),
        "rope": OracleCase(3, 4, 2, 1, 40, {"append": 1, "append_rope": True}, layout="rope"),
        "rope_causal": OracleCase(2, 4, 2, 3, 40, {"append": 3, "append_rope": True, "is_causal": True},
                                  layout="rope"),
        "ropehalf": OracleCase(3, 4, 2, 1, 40, {"append": 1, "append_rope": False}, layout="ropehalf"),
        "ropehalf_causal": OracleCase(2, 4, 2, 3, 40, {"append": 3, "append_rope": False, "is_causal": True},
                                      layout="ropehalf"),
    }
    launch_head_dims = (64, 128)  # the head_dims the oracle sweep runs (tests/cases.py; bf16 attention is built there)
    layouts = runtime.LAYOUTS
    dtypes = runtime.DTYPES
    tile_constraints = False  # one kernel per dtype and RoPE mode, serving every call

    def tier(self, target: Target) -> str | None:
        return "f64"

    def _spec(self, head_dim: int, threads: int, wave_size: int, layout: str | None = None,
              dtype: str | None = None) -> KernelSpec:
        return KernelSpec(family=self.name, head_dim=head_dim, gqa_group=1,
                          tile=Tile(br=1, bc=1, threads=threads, tm=1), wave_size=wave_size, tier="f64",
                          stage="f32", options=self.options({"layout": layout, "dtype": dtype}))

    def spec(self, target: Target, point: dict, tile: Tile) -> KernelSpec:
        return self._spec(point["head_dim"], tile.threads, target.wave_size, point.get("layout"), point.get("dtype"))

    def from_name(self, name: str) -> KernelSpec | None:
        v = self.schema.parse(name)
        return None if v is None else self._spec(v["head_dim"], v["tile.threads"], v["wave_size"],
                                                 v.get("options.layout"), v.get("options.dtype"))

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        return {}

    def context(self, spec: KernelSpec) -> dict:
        return {"bf16": spec.option("dtype") == "bf16", "rope": ROPE[spec.option("layout")]}


FAMILY = Append()
