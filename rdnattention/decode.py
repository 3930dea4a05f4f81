"""Calls on caches and packed batches, behind `flash_attn_with_kvcache` (paged caches,
cache_batch_idx, explicit num_splits) and the variable-length entry points (varlen.py): `run` is
the one place such a call is checked against memory and planned (route.py chooses the kernels:
the split-KV ones, or for a packed prefill the row-block ones compiled for packed batches); the
custom op `rdnattention::flash_attn_decode_fwd` wraps it for torch.compile and tensor subclasses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import checks, route
from .errors import InvalidArgumentError


@dataclass(frozen=True)
class Extents:
    """The sizes of a call whose tensors do not say them: q is [batch, seq_q, heads_q, head_dim], or
    packed [total_q, heads_q, head_dim] with cu_seqlens_q; k, v are [batch, seq_k, heads_kv,
    head_dim], packed [total_k, heads_kv, head_dim] with cu_seqlens_k, or a page pool [pages,
    page_size, heads_kv, head_dim] with block_table."""

    batch: int
    seq_q: int  # per batch; packed: the longest
    seq_k: int  # per batch at most; paged: pages per row x page size


def run(q, k, v, *, window: tuple[int, int], softmax_scale: float, return_lse: bool, extents: Extents,
        seqused_k=None, block_table=None, cache_batch_idx=None, cu_seqlens_q=None, cu_seqlens_k=None,
        num_splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Plans and runs a validated call (shapes and index values checked by the caller); returns
    (out, lse) in the layout of q (lse: [batch, heads_q, seq_q], packed [heads_q, total_q]; empty
    unless asked for)."""
    packed = cu_seqlens_q is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_memory(name, t)
        if t.data_ptr() % 16:
            raise InvalidArgumentError(f"{name} must start on a 16-byte boundary")
    # The index tensors' values were checked by the entry point (kvcache.py, varlen.py), before any
    # in-place append; here only that their memory is real.
    for name, t in (("seqused_k", seqused_k), ("block_table", block_table), ("cache_batch_idx", cache_batch_idx),
                    ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is not None:
            checks.check_memory(name, t)
    out, lse = allocate(q, return_lse, packed)
    if packed:  # [1, heads, total, head_dim] views
        qv, ov = q.unsqueeze(0).transpose(1, 2), out.unsqueeze(0).transpose(1, 2)
    else:
        qv, ov = q.transpose(1, 2), out.transpose(1, 2)
    if block_table is not None or k.dim() == 4:
        kv_, vv = k.transpose(1, 2), v.transpose(1, 2)  # [pages or batch, heads_kv, rows, head_dim]
    else:
        kv_, vv = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
    if extents.batch == 0 or out.numel() == 0:
        lse.fill_(float("-inf"))
        return out, lse
    call = route.Attention(q=qv, k=kv_, v=vv, out=ov, lse=lse if return_lse else None, window=window,
                           softmax_scale=softmax_scale, batch=extents.batch, seq_q=extents.seq_q,
                           seq_k=extents.seq_k, seqused_k=seqused_k, cache_batch_idx=cache_batch_idx,
                           block_table=block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           num_splits=num_splits)
    route.plan(route.device_table(q.device), call).run()
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
        extents = kw["extents"]
        return flash_attn_decode_fwd(q, k, v, kw.get("seqused_k"), kw.get("block_table"), kw.get("cache_batch_idx"),
                                     kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k"), extents.batch, extents.seq_q,
                                     extents.seq_k, kw["window"][0], kw["window"][1], kw["softmax_scale"],
                                     kw["return_lse"], kw.get("num_splits", 0))
    return run(q, k, v, **kw)


@torch.library.custom_op("rdnattention::flash_attn_decode_fwd", mutates_args=())
def flash_attn_decode_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: Optional[torch.Tensor],
                          block_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
                          cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], batch: int,
                          seq_q: int, seq_k: int, window_left: int, window_right: int, softmax_scale: float,
                          return_lse: bool, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    return run(q, k, v, window=(window_left, window_right), softmax_scale=softmax_scale, return_lse=return_lse,
               extents=Extents(batch=batch, seq_q=seq_q, seq_k=seq_k), seqused_k=seqused_k, block_table=block_table,
               cache_batch_idx=cache_batch_idx, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
               num_splits=num_splits)


@flash_attn_decode_fwd.register_fake
def _(q, k, v, seqused_k, block_table, cache_batch_idx, cu_seqlens_q, cu_seqlens_k, batch, seq_q, seq_k,
      window_left, window_right, softmax_scale, return_lse, num_splits):
    return allocate(q, return_lse, cu_seqlens_q is not None)
