"""Plans: a validated call becomes a list of launches (kernel, grid, block, shared memory,
arguments), planned by the kernel family, then run on the device's driver. A family that needs
two kernels or a scratch buffer returns two launches and keeps the buffer in the plan."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .dispatch import KernelEntry, TargetTable

if TYPE_CHECKING:  # the generator imports the families, and with them this module, without torch
    import torch


@dataclass(frozen=True)
class Launch:
    kernel: KernelEntry
    grid: tuple[int, int, int]
    block: int
    shared_bytes: int
    args: ctypes.Structure


@dataclass
class Plan:
    table: TargetTable
    device: torch.device
    launches: list[Launch]
    # What the call returns (None where an optional output was not asked for).
    outputs: tuple[torch.Tensor | None, ...]
    # Every tensor the launches read or write (inputs, outputs, scratch): held as long as the plan is.
    buffers: tuple[torch.Tensor, ...] = field(default=())

    def run(self) -> None:
        from . import drivers

        driver = drivers.for_platform(self.table.platform)
        for launch in self.launches:
            driver.launch(self.table.code_object, launch, self.device)
