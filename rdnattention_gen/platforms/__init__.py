"""Platforms, generator side: amdgcn, cuda, host. Found by discovery (each module defines PLATFORM)."""

from __future__ import annotations

import importlib
import pkgutil

from ..platform import Platform


def _discover() -> dict[str, Platform]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        plat = importlib.import_module(f"{__name__}.{info.name}").PLATFORM
        found[plat.name] = plat
    return found


PLATFORMS: dict[str, Platform] = _discover()


def platform(name: str) -> Platform:
    return PLATFORMS[name]
