"""Kernel specs and their names: one frozen spec per generated kernel, one name that is its file
stem, symbol and dispatch id, and that parses back into the spec. Each family owns its name
schema; optional fields appear in a name only when set, so adding one leaves every existing
name unchanged."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True, order=True)
class Tile:
    br: int       # query rows per workgroup (all heads of the GQA group together)
    bc: int       # keys per step
    threads: int  # workgroup size
    tm: int       # query rows per thread (the height of each thread's register tile)


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
        from .families import family
        return family(self.family).schema.name(self)

    @classmethod
    def from_name(cls, name: str) -> "KernelSpec":
        from .families import FAMILIES
        for fam in FAMILIES.values():
            spec = fam.from_name(name)
            if spec is not None:
                return spec
        raise ValueError(f"not a kernel name: {name!r}")

    @property
    def lds_bytes(self) -> int:
        """LDS one workgroup of this kernel allocates (its family's layout)."""
        from .families import family
        return family(self.family).lds_bytes(self)

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


@dataclass(frozen=True)
class NameField:
    key: str                    # KernelSpec.value key
    text: str                   # how it is spelled, "{}" for the value: "_hd{}"
    pattern: str                # regular expression of the value
    convert: Callable[[str], object] = int
    optional: bool = False      # spelled only when set (truthy)


class NameSchema:
    """``prefix`` then each field in order; parse() inverts name()."""

    def __init__(self, prefix: str, fields: tuple[NameField, ...]):
        self.prefix, self.fields = prefix, fields
        parts = [re.escape(prefix)]
        for i, f in enumerate(fields):
            before, after = (re.escape(x) for x in f.text.split("{}"))
            group = f"{before}(?P<f{i}>{f.pattern}){after}"
            parts.append(f"(?:{group})?" if f.optional else group)
        self._regex = re.compile("".join(parts))

    def name(self, spec: KernelSpec) -> str:
        out = [self.prefix]
        for f in self.fields:
            value = spec.value(f.key)
            if f.optional and not value:
                continue
            out.append(f.text.format(value))
        return "".join(out)

    def parse(self, name: str) -> dict[str, object] | None:
        m = self._regex.fullmatch(name)
        if not m:
            return None
        return {f.key: f.convert(m[f"f{i}"]) for i, f in enumerate(self.fields) if m[f"f{i}"] is not None}
