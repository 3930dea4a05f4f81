"""Find the compiler and binutils; never assume a path."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


class ToolchainError(RuntimeError):
    """No usable compiler or tool was found; the message says where we looked."""


@dataclass(frozen=True)
class Toolchain:
    clang: str
    readelf: str
    objdump: str
    identity: str  # first line of `clang --version`; part of the rebuild key

    @property
    def clangxx(self) -> list[str]:
        return [self.clang, "--driver-mode=g++"]


def _has_amdgpu(clang: str) -> bool:
    try:
        out = subprocess.run([clang, "--print-targets"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "amdgcn" in out


def _sibling(clang: str, tool: str) -> str | None:
    """llvm-<tool> from the same installation: clang-22 -> llvm-objdump-22."""
    path = Path(clang)
    suffix = path.name[len("clang"):] if path.name.startswith("clang") else ""
    for name in (f"{tool}{suffix}", tool):
        candidate = path.parent / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(f"{tool}{suffix}") or shutil.which(tool)
    return found


@functools.lru_cache(maxsize=None)
def find() -> Toolchain:
    tried = []
    candidates = []
    if os.environ.get("RDNATTENTION_CLANG"):
        candidates.append(os.environ["RDNATTENTION_CLANG"])
    rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
    candidates.append(str(Path(rocm) / "llvm" / "bin" / "clang"))
    candidates += [c for c in (shutil.which("clang-22"), shutil.which("clang")) if c]
    for clang in candidates:
        resolved = shutil.which(clang) or (clang if Path(clang).is_file() else None)
        if not resolved:
            tried.append(f"{clang} (not found)")
            continue
        if not _has_amdgpu(resolved):
            tried.append(f"{resolved} (no AMDGPU target)")
            continue
        readelf, objdump = _sibling(resolved, "llvm-readelf"), _sibling(resolved, "llvm-objdump")
        if not readelf or not objdump:
            tried.append(f"{resolved} (no llvm-readelf/llvm-objdump beside it)")
            continue
        version = subprocess.run([resolved, "--version"], capture_output=True, text=True).stdout
        return Toolchain(clang=resolved, readelf=readelf, objdump=objdump,
                         identity=version.splitlines()[0].strip() if version else resolved)
    raise ToolchainError(
        "no clang with the AMDGPU target found; tried: " + "; ".join(tried) +
        ". Install one (Debian: apt-get install clang-22 lld-22) or set RDNATTENTION_CLANG.")
