"""Find the built kernels for a device and pick one per call, from the build-time tables."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import KernelsNotBuiltError, UnsupportedError

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent


@dataclass(frozen=True)
class KernelEntry:
    name: str
    kind: str
    head_dim: int
    gqa_group: int
    threads: int
    br: int
    bc: int
    lds_bytes: int
    priority: int
    tier: str


@dataclass(frozen=True)
class TargetTable:
    target: str
    platform: str
    code_object: Path
    kernels: tuple[KernelEntry, ...]

    def select(self, kind: str, head_dim: int, heads_per_kv: int) -> KernelEntry:
        """The highest-priority kernel whose GQA group divides the query heads per K/V head."""
        fits = [k for k in self.kernels
                if k.kind == kind and k.head_dim == head_dim and heads_per_kv % k.gqa_group == 0]
        if not fits:
            dims = sorted({k.head_dim for k in self.kernels if k.kind == kind})
            raise UnsupportedError(
                f"no {kind} kernel for head_dim {head_dim} on {self.target}; built head_dims: {dims}")
        return max(fits, key=lambda k: (k.priority, k.gqa_group))


def search_path() -> list[Path]:
    """Where built kernels are looked for: $RDNATTENTION_BUILD_DIR, the checkout's build/, the package."""
    paths = []
    if os.environ.get("RDNATTENTION_BUILD_DIR"):
        paths.append(Path(os.environ["RDNATTENTION_BUILD_DIR"]))
    if (_CHECKOUT / "variants.yaml").is_file():
        paths.append(_CHECKOUT / "build")  # a source checkout: its build wins over packaged kernels
    paths.append(_PACKAGE / "lib")
    return paths


@functools.lru_cache(maxsize=None)
def table_for(target: str) -> TargetTable:
    for root in search_path():
        path = root / target / "dispatch.json"
        if path.is_file():
            data = json.loads(path.read_text())
            code_object = root / target / data["code_object"]
            if not code_object.is_file():
                continue
            keep = KernelEntry.__dataclass_fields__
            kernels = tuple(KernelEntry(**{k: v for k, v in e.items() if k in keep}) for e in data["kernels"])
            return TargetTable(target=target, platform=data["platform"], code_object=code_object, kernels=kernels)
    looked = ", ".join(str(p / target) for p in search_path())
    raise KernelsNotBuiltError(
        f"no kernels built for target {target!r} (looked in {looked}); "
        f"build them with: rdnattention-gen build --targets {target}")
