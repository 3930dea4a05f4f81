"""Kernel families, generator side. Every module here defines ``FAMILY``; they are found by
discovery, so a new family is a new module (plus its template and its runtime module)."""

from __future__ import annotations

from rdnattention.discovery import modules

from ..family import Family
from ..spec import KernelSpec

FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in modules(__name__, __path__)}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None


def spec_from_name(name: str) -> KernelSpec:
    """The spec a kernel name encodes (``spec_from_name(spec.name) == spec``)."""
    for fam in FAMILIES.values():
        spec = fam.from_name(name)
        if spec is not None:
            return spec
    raise ValueError(f"not a kernel name: {name!r}")
