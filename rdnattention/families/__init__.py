"""Kernel families, runtime side: each module declares a family's name (``NAME``), how its kernel
names spell their facts (``NAMES``), its argument struct (``ARGS``), the LDS a kernel uses
(``lds_bytes``) and its launch planning (``plan``). Modules are found by discovery, so adding a family adds a module
here and edits nothing else in the runtime."""

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
