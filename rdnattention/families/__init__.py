"""Kernel families, runtime side: each module declares a family's name (``NAME``), how its kernel
names spell their facts (``NAMES``), its argument struct (``ARGS``) and the LDS a kernel uses
(``lds_bytes``); the generator reads these, and dispatch.py checks every table against them. A family
is one algorithm's kernels (f16, dec, i8, i8dec, append, bwd) and plans their launches; a family whose
kernels are also compiled for other ways of finding the keys (f16: cache lengths, packed batches;
dec: paged caches) lists them as ``LAYOUTS``, and its kernel names spell the option. Which family
and layout serve a call is route.py's choice. Modules are found by discovery, so adding a family
adds a module here."""

from __future__ import annotations

from types import ModuleType

from ..discovery import modules
from ..errors import UnsupportedError

FAMILIES: dict[str, ModuleType] = {m.NAME: m for m in modules(__name__, __path__)}


def family(name: str) -> ModuleType:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnsupportedError(f"unknown kernel family {name!r}; this runtime knows: "
                               f"{', '.join(sorted(FAMILIES))}") from None
