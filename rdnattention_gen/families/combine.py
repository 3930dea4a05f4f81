"""The combine step of split-KV decode: merges the dec family's partial outputs (fp32, no products).
It takes the dec family's threads per workgroup: one row per workgroup, in threads / (head_dim / 8)
groups (rounded down) of head_dim / 8 lanes that split the row's slices and meet in LDS.

Kernel body: templates/include/fa2_combine.h."""

from __future__ import annotations

from rdnattention.families import combine as runtime

from ..family import Family, HeadDimAxis, OracleCase, Rule
from ..spec import KernelSpec, Tile
from ..target import Target
from .f16 import WHOLE_WAVES

RULES = (
    Rule("lanes_per_row",
         lambda s, t: s.head_dim % 8 == 0 and s.tile.threads >= s.head_dim // 8,
         lambda s, t: f"head_dim {s.head_dim} must be a multiple of 8 and threads {s.tile.threads} at least "
                      f"head_dim / 8 = {s.head_dim // 8}"),
    WHOLE_WAVES,
)


class Combine(HeadDimAxis, Family):
    name = "combine"
    template = "fa2_combine.hip.j2"
    args = runtime.ARGS
    schema = runtime.NAMES
    rules = RULES
    signatures = {"fp32": "none"}  # fp32 only: no tier instruction to find
    # It runs after the dec kernels when a call asks for several key slices.
    oracle_cases = {
        "slices": OracleCase(2, 4, 2, 1, 300, {"num_splits": 3}),
        "slices_causal": OracleCase(1, 4, 1, 2, 257, {"num_splits": 5, "is_causal": True}),
        # Score transforms across slices: each row's sink joins once, in the combine.
        "slices_score": OracleCase(2, 4, 2, 1, 300, {"num_splits": 3, "softcap": 3.0, "alibi": "batch", "sinks": True}),
        "slices_sinks_causal": OracleCase(1, 4, 1, 2, 257, {"num_splits": 5, "is_causal": True, "sinks": True}),
    }
    dtypes = runtime.DTYPES  # bf16: the combine of the bf16 dec kernels stores bf16
    tiles_family = "dec"
    tile_constraints = False  # one combine per threads count, whatever rows the dec tile is for

    def tier(self, target: Target) -> str | None:
        return "fp32"

    def _spec(self, head_dim: int, threads: int, wave_size: int, dtype: str | None = None) -> KernelSpec:
        return KernelSpec(family=self.name, head_dim=head_dim, gqa_group=1,
                          tile=Tile(br=1, bc=1, threads=threads, tm=1), wave_size=wave_size, tier="fp32",
                          stage="f32", options=self.options({"dtype": dtype}))

    def spec(self, target: Target, point: dict, tile: Tile) -> KernelSpec:
        return self._spec(point["head_dim"], tile.threads, target.wave_size, point.get("dtype"))

    def from_name(self, name: str) -> KernelSpec | None:
        v = self.schema.parse(name)
        return None if v is None else self._spec(v["head_dim"], v["tile.threads"], v["wave_size"],
                                                 v.get("options.dtype"))

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        return runtime.lds_layout(spec.head_dim, spec.tile.threads)

    def context(self, spec: KernelSpec) -> dict:
        return {"lds_bytes": self.lds_bytes(spec), "bf16": spec.option("dtype") == "bf16"}


FAMILY = Combine()
