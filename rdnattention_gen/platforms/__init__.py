"""Platforms, generator side: amdgcn, cuda, host. Found by discovery (each module defines PLATFORM)."""

from __future__ import annotations

from rdnattention.discovery import modules

from ..platform import Platform

PLATFORMS: dict[str, Platform] = {m.PLATFORM.name: m.PLATFORM for m in modules(__name__, __path__)}


def platform(name: str) -> Platform:
    return PLATFORMS[name]
