"""Kernel families, generator side. Every module here defines ``FAMILY``; they are found by
discovery, so a new family is a new module (plus its template and its runtime module)."""

from __future__ import annotations

import importlib
import pkgutil

from ..family import Family


def _discover() -> dict[str, Family]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        fam = importlib.import_module(f"{__name__}.{info.name}").FAMILY
        found[fam.name] = fam
    return found


FAMILIES: dict[str, Family] = _discover()


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None
