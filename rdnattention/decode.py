"""Calls on caches and packed batches: the split-KV decode kernels (families/dec.py) behind
`flash_attn_with_kvcache` (paged caches, cache_batch_idx, explicit num_splits) and the
variable-length entry points (varlen.py), whose packed prefills (more than dec.MAX_ROWS query rows
per K/V head) run the row-block kernels compiled for packed batches (families/f16varlen.py).

`run` is the one place such a call is checked against memory and planned; the custom op
`rdnattention::flash_attn_decode_fwd` wraps it for torch.compile and tensor subclasses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import api
from .errors import InvalidArgumentError
from .families import dec, f16, f16varlen


@dataclass(frozen=True)
class Layout:
    """How the tensors of a decode call are laid out. q: [batch, seq_q, heads_q, head_dim], or
    packed [total_q, heads_q, head_dim] with cu_seqlens_q; k, v: [batch, seq_k, heads_kv, head_dim],
    packed [total_k, heads_kv, head_dim] with cu_seqlens_k, or a page pool [pages, page_size,
    heads_kv, head_dim] with block_table."""

    batch: int
    seq_q: int  # per batch; packed: the longest
    seq_k: int  # per batch at most; paged: pages per row x page size


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


can_read = api.can_read


def check_values(name: str, t: torch.Tensor | None, lo: int, hi: int) -> None:
    """Values in [lo, hi] (where they can be read: see can_read), in one device read."""
    if t is None or t.numel() == 0 or not can_read(t):
        return
    api._check_memory(name, t)
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


def run(q, k, v, *, window: tuple[int, int], softmax_scale: float, return_lse: bool, layout: Layout,
        seqused_k=None, block_table=None, cache_batch_idx=None, cu_seqlens_q=None, cu_seqlens_k=None,
        num_splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plans and runs a validated decode call (shapes and index values checked by the caller); returns (out, lse) in the layout of q (lse:
    [batch, heads_q, seq_q], packed [heads_q, total_q]; empty unless asked for)."""
    packed = cu_seqlens_q is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        api._check_memory(name, t)
        if t.data_ptr() % 16:
            raise InvalidArgumentError(f"{name} must start on a 16-byte boundary")
    # The index tensors' values were checked by the entry point (kvcache.py, varlen.py), before any
    # in-place append; here only that their memory is real.
    for name, t in (("seqused_k", seqused_k), ("block_table", block_table), ("cache_batch_idx", cache_batch_idx),
                    ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is not None:
            api._check_memory(name, t)
    out, lse = allocate(q, return_lse, packed)
    if packed:  # [1, heads, total, head_dim] views
        qv, ov = q.unsqueeze(0).transpose(1, 2), out.unsqueeze(0).transpose(1, 2)
    else:
        qv, ov = q.transpose(1, 2), out.transpose(1, 2)
    if block_table is not None or k.dim() == 4:
        kv_, vv = k.transpose(1, 2), v.transpose(1, 2)  # [pages or batch, heads_kv, rows, head_dim]
    else:
        kv_, vv = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
    if layout.batch == 0 or out.numel() == 0:
        lse.fill_(float("-inf"))
        return out, lse
    table = api._table(q.device)
    rows = q.shape[-2] // k.shape[-2] * layout.seq_q
    if (packed and cu_seqlens_k is not None and rows > dec.MAX_ROWS
            and table.entries(f16varlen.NAME, q.shape[-1])):  # a packed prefill: the row-block kernels
        f16.plan(table, f16.Call(q=qv, k=kv_, v=vv, out=ov, lse=lse if return_lse else None, window=window,
                                 softmax_scale=softmax_scale, seqused_k=seqused_k, cu_seqlens_q=cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k, packed=(layout.batch, layout.seq_q, layout.seq_k))).run()
        return out, lse
    call = dec.Call(q=qv, k=kv_, v=vv, out=ov, lse=lse if return_lse else None, window=window,
                    softmax_scale=softmax_scale, batch=layout.batch, seq_q=layout.seq_q, seq_k=layout.seq_k,
                    seqused_k=seqused_k, cache_batch_idx=cache_batch_idx, block_table=block_table,
                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, num_splits=num_splits)
    dec.plan(table, call).run()
    return out, lse


def allocate(q: torch.Tensor, return_lse: bool, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The output in q's layout (packed: zeros, so rows no sequence covers are zero, not stale) and
    the LSE."""
    out = (torch.zeros_like if packed else torch.empty_like)(q, memory_format=torch.contiguous_format)
    if not return_lse:
        return out, torch.empty((0,), dtype=torch.float32, device=q.device)
    if packed:
        return out, torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    return out, torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)


def forward(q, k, v, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """`run`, through the custom op where torch traces or the tensors are subclasses."""
    tensors = [t for t in (q, k, v, kw.get("seqused_k"), kw.get("block_table"), kw.get("cache_batch_idx"),
                           kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")) if t is not None]
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or not all(type(t) is torch.Tensor for t in tensors)):
        layout = kw["layout"]
        return flash_attn_decode_fwd(q, k, v, kw.get("seqused_k"), kw.get("block_table"), kw.get("cache_batch_idx"),
                                     kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k"), layout.batch, layout.seq_q,
                                     layout.seq_k, kw["window"][0], kw["window"][1], kw["softmax_scale"],
                                     kw["return_lse"], kw.get("num_splits", 0))
    return run(q, k, v, **kw)


@torch.library.custom_op("rdnattention::flash_attn_decode_fwd", mutates_args=())
def flash_attn_decode_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: Optional[torch.Tensor],
                          block_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
                          cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], batch: int,
                          seq_q: int, seq_k: int, window_left: int, window_right: int, softmax_scale: float,
                          return_lse: bool, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    return run(q, k, v, window=(window_left, window_right), softmax_scale=softmax_scale, return_lse=return_lse,
               layout=Layout(batch=batch, seq_q=seq_q, seq_k=seq_k), seqused_k=seqused_k, block_table=block_table,
               cache_batch_idx=cache_batch_idx, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
               num_splits=num_splits)


@flash_attn_decode_fwd.register_fake
def _(q, k, v, seqused_k, block_table, cache_batch_idx, cu_seqlens_q, cu_seqlens_k, batch, seq_q, seq_k,
      window_left, window_right, softmax_scale, return_lse, num_splits):
    return allocate(q, return_lse, cu_seqlens_q is not None)
