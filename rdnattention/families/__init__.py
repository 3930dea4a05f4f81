"""Kernel families, runtime side: each module declares a family's argument struct (``ARGS``) and
its launch planning (``plan``). Modules are found by discovery, so adding a family adds a module
here and edits nothing else in the runtime."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from ..errors import UnsupportedError


def _discover() -> dict[str, ModuleType]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found[module.NAME] = module
    return found


FAMILIES: dict[str, ModuleType] = _discover()


def family(name: str) -> ModuleType:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnsupportedError(f"unknown kernel family {name!r}; this runtime knows: "
                               f"{', '.join(sorted(FAMILIES))}") from None
