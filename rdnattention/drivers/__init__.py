"""Drivers, one per platform: which devices a driver serves, which target a device is, and how a
planned launch runs there. Each module defines PLATFORM, serves(device), target(device) and
launch(code_object, launch, device)."""

from __future__ import annotations

from types import ModuleType

import torch

from ..errors import UnsupportedError
from . import cuda, host

DRIVERS: dict[str, ModuleType] = {d.PLATFORM: d for d in (host, cuda)}


def for_platform(platform: str) -> ModuleType:
    try:
        return DRIVERS[platform]
    except KeyError:
        raise UnsupportedError(f"no driver for platform {platform!r} in this version; "
                               f"drivers: {', '.join(sorted(DRIVERS))}") from None


def target_of(device: torch.device) -> str:
    """The build target whose kernels run tensors on ``device``."""
    for driver in DRIVERS.values():
        if driver.serves(device):
            return driver.target(device)
    raise UnsupportedError(
        f"tensors on {device} are not served: this version runs CPU tensors on the host emulator and "
        "NVIDIA GPUs through the cuda platform; the HIP driver for AMD GPUs is not part of it yet")
