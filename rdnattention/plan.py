"""Plans: a validated call becomes a list of launches (kernel, grid, block, shared memory,
arguments), planned by the kernel family route.py chooses, then run on the device's driver. A
family whose launch needs scratch memory (split-KV: the slices' partials, and the counters by
which the last slice of a row chunk knows it is last) says how much: a plan run by
:meth:`Plan.run` allocates its own at its first run and keeps it; an eager call replays the plan
(replay.py) on its stream's workspace (workspace.py)."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import InvalidArgumentError
from .table import KernelEntry, TargetTable

if TYPE_CHECKING:  # the generator imports the families, and with them this module, without torch
    import torch

# The strictest of CUDA's and HIP's launch limits, applied on every platform (the host emulator
# included), so that a call one vendor refuses is refused on all, by us rather than the runtime.
GRID_X_MAX = 2**31 - 1      # workgroups in x (CUDA)
GRID_YZ_MAX = 65535         # workgroups in y and in z (CUDA)
# hipModuleLaunchKernel refuses a grid of more work-items than HSA's dispatch packet counts: its
# grid size is in work-items, a uint32.
WORK_ITEMS_MAX = 2**32 - 1


def _check_grid(name: str, grid: tuple[int, int, int], threads: int) -> None:
    """InvalidArgumentError naming the first launch limit that ``grid`` of kernel ``name``, with
    ``threads`` threads per workgroup, exceeds."""
    x, y, z = grid
    limits = ((x <= GRID_X_MAX, f"grid.x = {x} must be at most 2^31 - 1 workgroups (CUDA)"),
              (y <= GRID_YZ_MAX, f"grid.y = {y} must be at most {GRID_YZ_MAX} workgroups (CUDA)"),
              (z <= GRID_YZ_MAX, f"grid.z = {z} must be at most {GRID_YZ_MAX} workgroups (CUDA)"),
              (x * threads <= WORK_ITEMS_MAX,
               f"grid.x * threads = {x * threads} must be at most 2^32 - 1 work-items (HIP)"))
    for within, limit in limits:
        if not within:
            raise InvalidArgumentError(f"the launch grid {grid} of kernel {name} with {threads} threads exceeds "
                                       f"the launch limits: {limit}")


@dataclass(frozen=True)
class Launch:
    """One kernel launch, its grid within every vendor's limits (checked when it is made, so
    before anything runs)."""

    kernel: KernelEntry
    grid: tuple[int, int, int]
    block: int
    shared_bytes: int
    args: ctypes.Structure

    def __post_init__(self) -> None:
        _check_grid(self.kernel.name, self.grid, self.block)


@dataclass
class Plan:
    table: TargetTable
    device: torch.device
    launches: list[Launch]
    # What the call returns (None where an optional output was not asked for).
    outputs: tuple[torch.Tensor | None, ...]
    # Every tensor the launches read or write (inputs, outputs, scratch): held as long as the plan is.
    buffers: tuple[torch.Tensor, ...] = field(default=())
    # Split-KV scratch: bytes in all, and where the partial LSEs start (the partial outputs at 0);
    # the launches' part_o and part_lse point into it. 0: none.
    scratch_bytes: int = 0
    scratch_lse: int = 0
    # Split-KV counters (uint32, zero before a launch and after it) the launches' ``counters`` points
    # at: how many. 0: none.
    counters: int = 0
    # How the launches change with the keys' length alone (a split-KV plan over plain K/V rows:
    # _splitkv.Lengths), so that a replay may follow it; None where they change otherwise.
    lengths: object = None

    def returning(self, out: torch.Tensor, lse: torch.Tensor, *, empty: bool,
                  sinks: torch.Tensor | None = None) -> Plan:
        """This plan, returning ``(out, lse)`` (lse an empty tensor where it was not asked for: a custom
        op returns tensors). An ``empty`` call (no output rows, or no keys) launches nothing: its rows
        are zero and its LSE -inf, or with ``sinks`` (fp32 [heads]) each row's sink, as where the
        kernels find no key (the sink alone is in the softmax's sum)."""
        self.outputs = (out, lse)
        if empty:
            out.zero_()
            if sinks is not None and lse.dim() == 3:  # [batch, heads, seq]
                lse.copy_(sinks[None, :, None].expand_as(lse))
            else:
                lse.fill_(-math.inf)
            self.launches.clear()
        return self

    def run(self) -> None:
        """Runs the launches (again and again, for timing), on the plan's own scratch."""
        from . import drivers

        if self.scratch_bytes and self.launches and not self.launches[0].args.part_o:
            from . import workspace
            scratch = workspace.allocate(self.scratch_bytes, self.device)
            counters = workspace.allocate_counters(self.counters, self.device)
            self.buffers = (*self.buffers, scratch, counters)
            self.bind_scratch(scratch.data_ptr(), counters.data_ptr())
        driver = drivers.for_platform(self.table.platform)
        for launch in self.launches:
            driver.launch(self.table.code_object, launch, self.device)

    def bind_scratch(self, address: int, counters: int) -> None:
        """Points the launches' part_o and part_lse at the scratch starting at ``address``, and their
        counters at ``counters``."""
        for launch in self.launches:
            launch.args.part_o, launch.args.part_lse = address, address + self.scratch_lse
            launch.args.counters = counters
