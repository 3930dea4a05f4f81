"""Kernel specs and their names: one frozen spec per generated kernel, one name that is its file
stem, symbol and dispatch id, and that parses back into the spec (families.spec_from_name). Each
family's name schema and LDS layout are its runtime module's (rdnattention.families), which
checks every dispatch table against them."""

from __future__ import annotations

from dataclasses import dataclass, field

from rdnattention.families import family as runtime_family
from rdnattention.names import NameField, NameSchema  # noqa: F401  (re-exported for families)


@dataclass(frozen=True, order=True)
class Tile:
    br: int       # query rows per workgroup (all heads of the GQA group together)
    bc: int       # keys per step
    threads: int  # workgroup size
    tm: int       # query rows per thread (the height of each thread's register tile)
    # Waves per SIMD the kernel is compiled to keep resident: its register budget (amdgpu_waves_per_eu,
    # cuda launch_bounds). 0: the family's own rule (the compiler's choice for the row-block families).
    waves: int = 0

    @classmethod
    def from_name_fields(cls, v: dict) -> "Tile":
        return cls(br=v["tile.br"], bc=v["tile.bc"], threads=v["tile.threads"], tm=v["tile.tm"],
                   waves=v.get("tile.waves", 0))


@dataclass(frozen=True, order=True)
class KernelSpec:
    """One generated kernel. Family-specific axes beyond the common ones go in ``options``."""

    family: str
    head_dim: int
    gqa_group: int
    tile: Tile
    wave_size: int
    tier: str   # the family's lowering on this target (fp16: dot2, fma_mix, mad_mix, cvt_fma)
    stage: str  # LDS staging precision
    options: tuple[tuple[str, object], ...] = field(default=())

    @property
    def name(self) -> str:
        return runtime_family(self.family).NAMES.name(self.value)

    @property
    def lds_bytes(self) -> int:
        """LDS one workgroup of this kernel allocates: its family's layout, as the runtime module
        states it for the facts the name spells (and checks every dispatch entry against)."""
        fam = runtime_family(self.family)
        return fam.lds_bytes({f.key: self.value(f.key) for f in fam.NAMES.fields})

    def option(self, key: str, default: object = None) -> object:
        return dict(self.options).get(key, default)

    def value(self, key: str) -> object:
        """A field by schema key: ``head_dim``, ``tile.br``, ``options.split``."""
        if key.startswith("options."):
            return self.option(key[len("options."):])
        obj: object = self
        for part in key.split("."):
            obj = getattr(obj, part)
        return obj
