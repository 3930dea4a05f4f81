"""Kernel families, generator side. Every module here defines ``FAMILY``; they are found by
discovery, so a new family is a new module (plus its template and its runtime module)."""

from __future__ import annotations

from rdnattention.discovery import modules

from ..family import Family

FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in modules(__name__, __path__)}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None
