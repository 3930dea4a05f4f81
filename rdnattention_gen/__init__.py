"""rdnattention_gen: the kernel generator. variants.yaml and the templates are package data, found
through importlib.resources, so the generator runs the same from a checkout and from a wheel."""

from __future__ import annotations

import importlib.resources
import importlib.util
from pathlib import Path

__version__ = "0.1.0"

_MISSING = [m for m in ("jinja2", "yaml", "ninja") if importlib.util.find_spec(m) is None]
if _MISSING:
    raise ImportError(f"the generator needs {', '.join(_MISSING)}: pip install 'rdnattention[gen]' "
                      "(and clang-22, lld-22 and llvm-22 from your distribution)")


def _package_dir() -> Path:
    root = importlib.resources.files(__name__)
    path = Path(str(root))
    if not (path / "variants.yaml").is_file():
        raise RuntimeError(f"rdnattention_gen's package data is not on disk at {path}; "
                           "install the package unzipped (pip installs it so by default)")
    return path


PACKAGE_DIR = _package_dir()
TEMPLATES = PACKAGE_DIR / "templates"
INCLUDE_DIR = TEMPLATES / "include"
HOST_DIR = TEMPLATES / "host"
DEFAULT_VARIANTS = PACKAGE_DIR / "variants.yaml"
TUNED_DIR = PACKAGE_DIR / "tuned"
