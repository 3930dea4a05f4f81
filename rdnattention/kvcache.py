"""flash-attn's ``flash_attn_with_kvcache``: decode and chunked prefill against a preallocated KV
cache with per-sequence lengths, appending the new keys and values in place.

Plain caches with automatic key slices run as flash_attn calls with cache lengths (ops.py), the
others through decode.py; route.py chooses the kernels of both: the split-KV decode kernels for
paged caches, cache_batch_idx, explicit num_splits and calls with few query rows per K/V head, the
fp16 row-block kernels with cache lengths (f16 of layout len) otherwise. The in-place append and
RoPE on the new keys and the queries (reference.rotate, in float64) are torch operations, so
torch.compile traces them as they are."""

from __future__ import annotations

import torch

from . import decode, ops, padding
from .checks import TOKEN_MAJOR, can_read, check_fp16, check_int32, check_paged, check_values
from .errors import InvalidArgumentError
from .options import check_seqused, validate
from .reference import rotate


def _check_tables(cos: object, sin: object, interleaved: object, q: torch.Tensor) -> None:
    if (cos is None) != (sin is None):
        raise InvalidArgumentError("rotary_cos and rotary_sin must be given together")
    if not isinstance(interleaved, bool):
        raise InvalidArgumentError(f"rotary_interleaved must be a bool, got {interleaved!r}")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.float32, torch.float16):
            raise InvalidArgumentError(f"{name} must be a float32 or float16 tensor [positions, rotary_dim/2]")
        if t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}")
    if cos.shape != sin.shape or 2 * cos.shape[1] > q.shape[3]:
        raise InvalidArgumentError(f"rotary_cos {tuple(cos.shape)} and rotary_sin {tuple(sin.shape)} must have one "
                                   f"shape, with rotary_dim = 2 * width at most head_dim {q.shape[3]}")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), rotary_interleaved=True, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn's semantics: q [batch, seq_q, heads, head_dim]; k_cache, v_cache
    [batch_cache, cache_len, heads_kv, head_dim], or with ``block_table`` (int32 [batch, pages per
    sequence]) a page pool [pages, page_size, heads_kv, head_dim] (page_size a power of two);
    ``cache_batch_idx`` (int32 [batch]) the cache row of each sequence (default: its own);
    cache_seqlens (int, or int32 [batch]) the valid length of each sequence's cache (None: the whole
    cache). With k, v [batch, seq_new, heads_kv, head_dim], they are written into the cache in place
    at cache_seqlens (after RoPE at their positions when rotary_cos/rotary_sin are given; q is
    rotated at cache_seqlens + i under a causal or local mask, else at cache_seqlens), and attention
    covers cache_seqlens + seq_new keys. Queries align to the end of each sequence's keys.
    ``num_splits``: key slices of the split-KV kernels (0: chosen from the device). Returns out
    [batch, seq_q, heads, head_dim], with the LSE [batch, heads, seq_q] if return_softmax_lse. As
    flash-attn's entry does, a head_dim that is not a multiple of 8 (up to 256), or rows that are
    not contiguous and 16-byte aligned, run on padded copies (padding.py), the cache copied back."""
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise InvalidArgumentError(f"num_splits must be a non-negative int, got {num_splits!r}")
    if padding.needed(q, k_cache, v_cache, k, v):  # as flash-attn's entry (padding.py); the cache written back
        return padding.run(flash_attn_with_kvcache, dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v), dict(
            rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            rotary_interleaved=rotary_interleaved, num_splits=num_splits, return_softmax_lse=return_softmax_lse),
            scale_name="softmax_scale", written=("k_cache", "v_cache") if k is not None else ())
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_fp16(name, t, TOKEN_MAJOR)
    batch = q.shape[0]
    if v_cache.shape != k_cache.shape:
        raise InvalidArgumentError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape "
                                   f"{tuple(k_cache.shape)}")
    if block_table is not None and cache_batch_idx is not None:
        raise InvalidArgumentError("cache_batch_idx and block_table exclude each other: a paged cache is addressed "
                                   "through its block table")
    if block_table is not None:
        block_table = check_paged(k_cache, v_cache, block_table, batch, "k_cache", "v_cache")
        cache_len = block_table.shape[1] * k_cache.shape[1]
    else:
        cache_len = k_cache.shape[1]
        if cache_batch_idx is not None:
            cache_batch_idx = check_int32("cache_batch_idx", cache_batch_idx, (batch,), q.device)
            check_values("cache_batch_idx", cache_batch_idx, 0, k_cache.shape[0] - 1)
        elif k_cache.shape[0] != batch:
            raise InvalidArgumentError(f"q has batch {batch}, the cache {k_cache.shape[0]} (give cache_batch_idx to "
                                       "pick cache rows)")
    if (k is None) != (v is None):
        raise InvalidArgumentError("k and v must be given together")
    if rotary_cos is not None and k is None:
        raise InvalidArgumentError("rotary_cos/rotary_sin apply to the new k and q: give k and v with them")

    if cache_seqlens is None:
        lengths = torch.full((batch,), cache_len, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lengths = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        lengths = check_seqused(cache_seqlens, q.transpose(1, 2))
        if lengths is None:
            raise InvalidArgumentError("cache_seqlens must be an int or an int32 [batch] tensor")
    new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            check_fp16(name, t, TOKEN_MAJOR)
            if t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:] or t.shape != k.shape:
                raise InvalidArgumentError(f"{name} shape {tuple(t.shape)} must be [batch, seq_new, heads_kv, "
                                           f"head_dim] matching the cache {tuple(k_cache.shape)}")
        new = k.shape[1]
    if lengths.numel() and can_read(lengths) and not bool(((lengths >= 0) & (lengths + new <= cache_len)).all()):
        raise InvalidArgumentError(f"cache_seqlens + seq_new ({new}) must lie in [0, cache_len = {cache_len}], "
                                   f"got cache_seqlens {lengths.tolist()}")

    q_in = q
    if k is not None:
        positions = lengths.long()[:, None] + torch.arange(new, device=q.device)
        if rotary_cos is not None:
            _check_tables(rotary_cos, rotary_sin, rotary_interleaved, q)
            needed = int(lengths.max().item()) + max(new, q.shape[1]) if batch and can_read(lengths) else 0
            if rotary_cos.shape[0] < needed:
                raise InvalidArgumentError(f"rotary tables have {rotary_cos.shape[0]} positions; the new keys and "
                                           f"queries need {needed}")
            k = rotate(k.transpose(1, 2), rotary_cos, rotary_sin, positions, rotary_interleaved).transpose(1, 2)
            local = causal or tuple(window_size) != (-1, -1)
            q_pos = lengths.long()[:, None] + (torch.arange(q.shape[1], device=q.device) if local else 0)
            q_in = rotate(q.transpose(1, 2), rotary_cos, rotary_sin, q_pos.expand(batch, q.shape[1]),
                          rotary_interleaved).transpose(1, 2)
        if block_table is not None:  # page block_table[b, pos // page], row pos % page
            page = k_cache.shape[1]
            slots = block_table.long().gather(1, positions // page)
            k_cache[slots, positions % page] = k
            v_cache[slots, positions % page] = v
        else:
            rows = (cache_batch_idx.long() if cache_batch_idx is not None
                    else torch.arange(batch, device=q.device))[:, None]
            k_cache[rows, positions] = k
            v_cache[rows, positions] = v
        lengths = lengths + new
    lengths = lengths.to(torch.int32)

    qv = q_in.transpose(1, 2)
    if block_table is None and cache_batch_idx is None:
        kv, vv = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    else:  # stand-ins of the logical [batch, heads_kv, cache_len, head_dim] shape: validation reads only shapes
        kv = vv = k_cache.new_empty(k_cache.shape[-1]).as_strided(
            (batch, k_cache.shape[2], cache_len, k_cache.shape[3]), (0, 0, 0, 1))
    o = validate(qv, kv, vv, is_causal=causal, window_size=window_size, softmax_scale=softmax_scale,
                 rotary_cos=None, rotary_sin=None, rotary_interleaved=False, return_lse=return_softmax_lse,
                 seqused_k=lengths)
    # Plain caches with automatic slices run as flash_attn calls (its custom op takes strided tensors
    # only); the others through the decode op.
    if block_table is None and cache_batch_idx is None and num_splits == 0:
        out, lse = ops.forward(qv, kv, vv, o, token_major=True)
        out = out.transpose(1, 2)
        return (out, lse) if return_softmax_lse else out
    out, lse = decode.forward(q_in, k_cache, v_cache, window=(o.window_left, o.window_right),
                              softmax_scale=o.softmax_scale, return_lse=return_softmax_lse,
                              extents=decode.Extents(batch=batch, seq_q=q.shape[1], seq_k=cache_len),
                              seqused_k=lengths, block_table=block_table, cache_batch_idx=cache_batch_idx,
                              num_splits=num_splits)
    return (out, lse) if return_softmax_lse else out
