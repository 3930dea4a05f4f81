"""flash-attn's ``flash_attn_with_kvcache``: decode and chunked prefill against a preallocated KV
cache with per-sequence lengths, appending the new keys and values in place.

The attention itself is the fp16 kernel with cache lengths (the f16len family, through
``seqused_k``). The in-place append and RoPE on the new keys and the queries (reference.rotate, in
float64) are torch operations, so torch.compile traces them as they are."""

from __future__ import annotations

import torch

from . import api
from .errors import InvalidArgumentError, UnsupportedError
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
    [batch, cache_len, heads_kv, head_dim]; cache_seqlens (int, or int32 [batch]) the valid length
    of each sequence's cache (None: the whole cache). With k, v [batch, seq_new, heads_kv, head_dim],
    they are written into the cache in place at cache_seqlens (after RoPE at their positions when
    rotary_cos/rotary_sin are given; q is rotated at cache_seqlens + i under a causal or local mask,
    else at cache_seqlens), and attention covers cache_seqlens + seq_new keys. Queries align to the
    end of each sequence's keys. Returns out [batch, seq_q, heads, head_dim], with the LSE
    [batch, heads, seq_q] if return_softmax_lse. cache_batch_idx and block_table (paged caches) and
    num_splits > 1 (split-KV) raise UnsupportedError: not implemented yet."""
    if cache_batch_idx is not None:
        raise UnsupportedError("cache_batch_idx is not implemented yet; index the cache before the call")
    if block_table is not None:
        raise UnsupportedError("block_table (paged KV) is not implemented yet")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise InvalidArgumentError(f"num_splits must be a non-negative int, got {num_splits!r}")
    if num_splits > 1:
        raise UnsupportedError(f"num_splits={num_splits}: split-KV is not implemented yet; pass 0 or 1")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        api._check_tensor(name, t, api._TOKEN_MAJOR)
    batch, cache_len = k_cache.shape[0], k_cache.shape[1]
    if v_cache.shape != k_cache.shape:
        raise InvalidArgumentError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape "
                                   f"{tuple(k_cache.shape)}")
    if q.shape[0] != batch:
        raise InvalidArgumentError(f"q has batch {q.shape[0]}, the cache {batch}")
    if (k is None) != (v is None):
        raise InvalidArgumentError("k and v must be given together")
    if rotary_cos is not None and k is None:
        raise InvalidArgumentError("rotary_cos/rotary_sin apply to the new k and q: give k and v with them")

    if cache_seqlens is None:
        lengths = torch.full((batch,), cache_len, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lengths = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        lengths = api._check_seqused(cache_seqlens, q.transpose(1, 2))
        if lengths is None:
            raise InvalidArgumentError("cache_seqlens must be an int or an int32 [batch] tensor")
    new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            api._check_tensor(name, t, api._TOKEN_MAJOR)
            if t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:] or t.shape != k.shape:
                raise InvalidArgumentError(f"{name} shape {tuple(t.shape)} must be [batch, seq_new, heads_kv, "
                                           f"head_dim] matching the cache {tuple(k_cache.shape)}")
        new = k.shape[1]
    if lengths.numel() and not bool(((lengths >= 0) & (lengths + new <= cache_len)).all()):
        raise InvalidArgumentError(f"cache_seqlens + seq_new ({new}) must lie in [0, cache_len = {cache_len}], "
                                   f"got cache_seqlens {lengths.tolist()}")

    q_in = q
    if k is not None:
        positions = lengths.long()[:, None] + torch.arange(new, device=q.device)
        if rotary_cos is not None:
            _check_tables(rotary_cos, rotary_sin, rotary_interleaved, q)
            needed = int(lengths.max().item()) + max(new, q.shape[1]) if batch else 0
            if rotary_cos.shape[0] < needed:
                raise InvalidArgumentError(f"rotary tables have {rotary_cos.shape[0]} positions; the new keys and "
                                           f"queries need {needed}")
            k = rotate(k.transpose(1, 2), rotary_cos, rotary_sin, positions, rotary_interleaved).transpose(1, 2)
            local = causal or tuple(window_size) != (-1, -1)
            q_pos = lengths.long()[:, None] + (torch.arange(q.shape[1], device=q.device) if local else 0)
            q_in = rotate(q.transpose(1, 2), rotary_cos, rotary_sin, q_pos.expand(batch, q.shape[1]),
                          rotary_interleaved).transpose(1, 2)
        rows = torch.arange(batch, device=q.device)[:, None]
        k_cache[rows, positions] = k
        v_cache[rows, positions] = v
        lengths = lengths + new

    qv, kv, vv = (t.transpose(1, 2) for t in (q_in, k_cache, v_cache))
    o = api._validate(qv, kv, vv, is_causal=causal, window_size=window_size, softmax_scale=softmax_scale,
                      rotary_cos=None, rotary_sin=None, rotary_interleaved=False, return_lse=return_softmax_lse,
                      seqused_k=lengths.to(torch.int32))
    out, lse = api.forward(qv, kv, vv, o, token_major=True)
    out = out.transpose(1, 2)
    return (out, lse) if return_softmax_lse else out
