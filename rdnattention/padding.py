"""flash-attn's entry behaviour for rows the kernels do not read as they are, at its entry points
(`flash_attn_func`, `flash_attn_varlen_func`, `flash_attn_with_kvcache`): a head_dim that is not a
multiple of 8 (up to 256) is padded with zeros to the next one and the output sliced back to it,
and a tensor whose last dimension is not contiguous or whose rows do not start on 16-byte
boundaries is copied into one whose rows do. The kernels read whole 16-byte chunks of rows on
16-byte boundaries; zero columns add nothing to the scores and give zero output columns, so the
result is the unpadded one. The softmax scale defaults to 1/sqrt of the head_dim as given.

Only calls that need it take this path (they pay a copy of the tensors concerned, as in
flash-attn); a call whose tensors are not what the entry point accepts at all (dtype, rank,
mismatched head_dims) is left to the entry point's own checks and errors."""

from __future__ import annotations

import math
from typing import Callable

import torch

from .errors import InvalidArgumentError, UnsupportedError

MULTIPLE = 8        # head_dims the kernels read: whole 16-byte chunks of fp16 or bf16
PADDED_UP_TO = 256  # flash-attn pads head_dims up to this; above it the kernels take multiples of 32


def _aligned(t: torch.Tensor) -> bool:
    """Rows the kernels read as they are: the last dimension contiguous, every other stride a
    multiple of 8 elements (16 bytes) and the data on a 16-byte boundary (not checked while torch
    traces nor on tensor subclasses: they may have no data pointer, and the run itself checks it)."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return False
    if any(s % MULTIPLE for s in t.stride()[:-1]):
        return False
    if torch.compiler.is_compiling() or type(t) is not torch.Tensor or t.numel() == 0:
        return True
    return t.data_ptr() % 16 == 0


def needed(*tensors: object, ranks: tuple[int, ...] = (4,), in_place: tuple = ()) -> bool:
    """Whether a call on these tensors (None: not given) takes the padded path: all fp16 (or all
    bf16) tensors of the ``ranks`` the entry point takes and of one head_dim, and some of them not
    read as they are (that head_dim not a multiple of 8, or rows not contiguous and 16-byte
    aligned). ``in_place``: those of them the entry point updates in place (a KV cache), which are
    never copied only to align their rows: as flash-attn does, the entry point refuses such a cache
    with its own error."""
    given = [t for t in tensors if t is not None]
    if not given or not all(isinstance(t, torch.Tensor) and not t.is_nested and t.layout is torch.strided
                            and t.dtype in (torch.float16, torch.bfloat16) and t.dtype == given[0].dtype
                            and t.dim() in ranks for t in given):  # (nested, sparse: the entry point names them)
        return False
    if len({t.shape[-1] for t in given}) != 1:
        return False  # the entry point names the mismatch
    return given[0].shape[-1] % MULTIPLE != 0 or not all(
        _aligned(t) for t in given if not any(t is c for c in in_place))


def refuse(head_dim: int) -> None:
    """For the entry points that copy nothing (the native layout): a head_dim that is not a
    multiple of 8 is an InvalidArgumentError naming it."""
    if head_dim % MULTIPLE:
        raise InvalidArgumentError(f"head_dim {head_dim} is not a multiple of {MULTIPLE}: the kernels read rows in "
                                   "16-byte chunks; pad it with zero columns (flash-attn's entry points here, "
                                   "flash_attn_func among them, pad up to 256 as flash-attn does)")


def _prepared(t: torch.Tensor | None, pad: int) -> torch.Tensor | None:
    """``t`` as the kernels read it: ``pad`` zero columns appended, or its rows copied onto 16-byte
    boundaries; ``t`` itself where neither is needed."""
    if t is None or (pad == 0 and _aligned(t)):
        return t
    out = t.new_zeros((*t.shape[:-1], t.shape[-1] + pad))
    out[..., :t.shape[-1]] = t
    return out


def run(entry: Callable, tensors: dict[str, torch.Tensor | None], kwargs: dict, *, scale_name: str,
        written: tuple[str, ...] = (), in_place: tuple[str, ...] = ()):
    """Calls ``entry`` with ``tensors`` prepared (_prepared) and ``kwargs``, the softmax scale
    (keyword ``scale_name``) defaulting to 1/sqrt of the head_dim as given; returns its result with
    the output (the result, or its first item) sliced back to that head_dim. ``written``: tensors
    the entry point writes in place (the KV cache), copied back where a prepared copy took them;
    ``in_place``: tensors copied only to pad their head_dim, never to align their rows (needed)."""
    head_dim = next(t for t in tensors.values() if t is not None).shape[-1]
    pad = -head_dim % MULTIPLE
    if pad and head_dim > PADDED_UP_TO:
        raise UnsupportedError(f"head_dim {head_dim} is not a multiple of {MULTIPLE}: head_dims up to "
                               f"{PADDED_UP_TO} are padded to one, larger ones must be multiples of 32 "
                               "(288 to 512)")
    rotary_cos = kwargs.get("rotary_cos")
    if isinstance(rotary_cos, torch.Tensor) and rotary_cos.dim() == 2 and 2 * rotary_cos.shape[1] > head_dim:
        raise InvalidArgumentError(f"rotary_dim {2 * rotary_cos.shape[1]} (2 * table width) exceeds head_dim "
                                   f"{head_dim}")
    if kwargs.get(scale_name) is None:
        kwargs = {**kwargs, scale_name: 1.0 / math.sqrt(head_dim)}
    prepared = {name: t if pad == 0 and name in in_place else _prepared(t, pad) for name, t in tensors.items()}
    result = entry(**prepared, **kwargs)
    for name in written:
        if prepared[name] is not tensors[name]:
            tensors[name].copy_(prepared[name][..., :head_dim])
    if isinstance(result, tuple):
        return (result[0][..., :head_dim], *result[1:])
    return result[..., :head_dim]
