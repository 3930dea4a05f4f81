"""Registries by discovery: every module of a package is an entry, so adding one edits no list.
A module whose name starts with an underscore is a helper its package's entries share, not an entry."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Iterable


def modules(package: str, path: Iterable[str]) -> list[ModuleType]:
    """Imports every module of ``package`` (its ``__path__``) but its helpers, in name order."""
    return [importlib.import_module(f"{package}.{info.name}")
            for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name) if not info.name.startswith("_")]
