"""Find the compiler and binutils; never assume a path."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


class ToolchainError(RuntimeError):
    """No usable compiler or tool was found; the message says where we looked."""


@dataclass(frozen=True)
class Toolchain:
    clang: str
    readelf: str
    objdump: str
    nm: str
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
        readelf, objdump, nm = (_sibling(resolved, t) for t in ("llvm-readelf", "llvm-objdump", "llvm-nm"))
        if not readelf or not objdump or not nm:
            tried.append(f"{resolved} (no llvm-readelf/llvm-objdump/llvm-nm beside it)")
            continue
        version = subprocess.run([resolved, "--version"], capture_output=True, text=True).stdout
        return Toolchain(clang=resolved, readelf=readelf, objdump=objdump, nm=nm,
                         identity=version.splitlines()[0].strip() if version else resolved)
    raise ToolchainError(
        "no clang with the AMDGPU target found; tried: " + "; ".join(tried) +
        ". Install one (Debian: apt-get install clang-22 lld-22) or set RDNATTENTION_CLANG.")


def _ptxas_candidates() -> list[str]:
    found = []
    if os.environ.get("RDNATTENTION_PTXAS"):
        found.append(os.environ["RDNATTENTION_PTXAS"])
    # PyPI's nvidia-cuda-nvcc-cu12 carries a ptxas that still assembles Pascal (sm_60/61).
    spec = importlib.util.find_spec("nvidia.cuda_nvcc") if importlib.util.find_spec("nvidia") else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        found.append(str(Path(root) / "bin" / "ptxas"))
    if shutil.which("ptxas"):
        found.append(shutil.which("ptxas"))
    return [p for p in dict.fromkeys(found) if Path(p).is_file()]


_PROBE_PTX = ".version 8.0\n.target {arch}\n.address_size 64\n.visible .entry probe() {{ ret; }}\n"


@functools.lru_cache(maxsize=None)
def find_ptxas(arch: str) -> str:
    """A ptxas that assembles ``arch`` (e.g. sm_61); raises ToolchainError saying what was tried."""
    tried = []
    for ptxas in _ptxas_candidates():
        with tempfile.TemporaryDirectory(prefix="rdna-ptxas-") as tmp:
            src = Path(tmp) / "probe.ptx"
            src.write_text(_PROBE_PTX.format(arch=arch))
            r = subprocess.run([ptxas, f"-arch={arch}", str(src), "-o", str(Path(tmp) / "probe.cubin")],
                               capture_output=True, text=True)
        if r.returncode == 0:
            return ptxas
        tried.append(f"{ptxas} ({(r.stderr.strip().splitlines() or ['failed'])[-1]})")
    raise ToolchainError(
        f"no ptxas assembles {arch}; tried: {'; '.join(tried) or 'none found'}. "
        "Install one with: pip install nvidia-cuda-nvcc-cu12 (its ptxas covers sm_50 to sm_90), "
        "or set RDNATTENTION_PTXAS.")
