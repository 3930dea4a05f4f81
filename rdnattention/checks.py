"""Checks of the tensors a call passes: dtype, rank and layout, the memory behind them, index
tensors and their values, page pools. Each raises InvalidArgumentError naming the tensor, what it
is and what is accepted; none modifies its argument."""

from __future__ import annotations

import torch

from .errors import InvalidArgumentError

NATIVE = "[batch, heads, seq, head_dim]"
TOKEN_MAJOR = "[batch, seq, heads, head_dim]"


def check_fp16(name: str, t: object, layout: str) -> torch.Tensor:
    """A float16 tensor of four dimensions; ``layout`` names them in the message."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float16:
        raise InvalidArgumentError(f"{name} must be float16, got {t.dtype}")
    if t.dim() != 4:
        raise InvalidArgumentError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
    return t


def check_rows(name: str, t: torch.Tensor) -> None:
    """The kernel's view [batch, heads, seq, head_dim]: contiguous rows on 16-byte multiples."""
    stride = t.stride()
    per16 = 16 // t.element_size()
    if stride[3] != 1 and t.shape[3] > 1:
        raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {stride}")
    if stride[0] % per16 or stride[1] % per16 or stride[2] % per16:
        raise InvalidArgumentError(
            f"{name} rows must start on 16-byte boundaries: strides {stride[:3]} must be multiples of {per16} "
            f"elements and the data pointer 16-byte aligned")


def reach(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last, by its shape and strides."""
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def check_memory(name: str, t: torch.Tensor) -> None:
    """The tensor has memory the kernel can read: a real pointer, a storage covering every element
    its shape and strides reach, no lazy negation or conjugation."""
    if t.is_neg() or t.is_conj():
        raise InvalidArgumentError(f"{name} is a lazily negated or conjugated view; pass {name}.resolve_neg() "
                                   "(or .resolve_conj())")
    if t.numel() == 0:
        return
    if t.data_ptr() == 0:
        raise InvalidArgumentError(f"{name} has no memory behind it (null data pointer: a freed or resized-away "
                                   "storage, or a meta tensor)")
    extent = t.storage_offset() * t.element_size() + reach(t)
    if extent > t.untyped_storage().nbytes():
        raise InvalidArgumentError(f"{name}'s shape {tuple(t.shape)} and strides {t.stride()} reach {extent} bytes "
                                   f"but its storage holds {t.untyped_storage().nbytes()}")


def can_read(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values: not while torch.compile traces (a data-dependent
    branch breaks the graph) nor while a CUDA graph is captured (a device read is not allowed).
    Those calls rely on their eager run having been checked; the kernels clamp lengths."""
    return not (torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def check_int32(name: str, t: object, shape: tuple[int, ...] | int, device: torch.device) -> torch.Tensor:
    """An int32 tensor of ``shape`` (an int: its number of dimensions) on ``device``, contiguous rows."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    want = f"{shape}-D" if isinstance(shape, int) else str(tuple(shape))
    if t.dtype != torch.int32 or (t.dim() != shape if isinstance(shape, int) else tuple(t.shape) != tuple(shape)):
        raise InvalidArgumentError(f"{name} must be int32 {want}, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device}, q on {device}")
    if t.numel() > 1 and t.stride(-1) != 1:
        raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    return t


def check_values(name: str, t: torch.Tensor | None, lo: int, hi: int) -> None:
    """Values in [lo, hi] (where they can be read: see can_read), in one device read."""
    if t is None or t.numel() == 0 or not can_read(t):
        return
    check_memory(name, t)
    low, high = torch.stack([t.min(), t.max()]).tolist()
    if low < lo or high > hi:
        raise InvalidArgumentError(f"{name} values must lie in [{lo}, {hi}], got {low}..{high}")


def check_paged(k: torch.Tensor, v: torch.Tensor, block_table: object, batch: int, k_name: str,
                v_name: str) -> torch.Tensor:
    """A page pool [pages, page_size, heads_kv, head_dim] (page_size a power of two, K and V with one
    layout) and its int32 [batch, pages per sequence] table, whose values name pages of the pool."""
    table = check_int32("block_table", block_table, 2, k.device)
    if table.shape[0] != batch:
        raise InvalidArgumentError(f"block_table has {table.shape[0]} rows; there are {batch} sequences")
    page = k.shape[1]
    if page < 1 or page & (page - 1):
        raise InvalidArgumentError(f"the page size ({k_name}.shape[1] = {page}) must be a power of two; "
                                   "16 to 256 are the sizes tested")
    if k.stride() != v.stride():
        raise InvalidArgumentError(f"paged {k_name} and {v_name} must share one layout, got strides {k.stride()} "
                                   f"and {v.stride()}")
    check_values("block_table", table, 0, k.shape[0] - 1)
    return table
