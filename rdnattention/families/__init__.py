"""Kernel families, runtime side: each module declares a family's name (``NAME``), how its kernel
names spell their facts (``NAMES``), its argument struct (``ARGS``) and the LDS a kernel uses
(``lds_bytes``); the generator reads these, and dispatch.py checks every table against them. An
algorithm's base family (f16, dec, i8, i8dec, combine) also plans its launches; its variants
compiled for another layout (f16len, f16varlen, decpaged) only declare. Which family serves a call
is route.py's choice. Modules are found by discovery, so adding a family adds a module here."""

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
