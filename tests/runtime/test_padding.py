"""flash-attn's entry behaviour at its entry points (rdnattention/padding.py): a head_dim that is
not a multiple of 8 (up to 256) is padded with zeros and the output sliced back, and rows that are
not contiguous or not on 16-byte boundaries are copied, with the results of the unpadded call
(the float64 oracle at the head_dim given, its default scale 1/sqrt(head_dim)); the KV cache
flash_attn_with_kvcache appends to is the caller's. On the host targets, whose head_dims include
8, 40, 64 and 80 (variants.yaml)."""

import math

import pytest
import torch

from rdnattention import (attention_reference, flash_attn, flash_attn_func, flash_attn_varlen_func,
                          flash_attn_with_kvcache, rotary_tables, scaled_dot_product_attention)
from rdnattention.errors import InvalidArgumentError, UnsupportedError

TOL = 2e-3


def _token_major(b, s, h, d, seed):
    return torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(seed)).half()


def _reference(q, k, v, **options):
    """The oracle on token-major q, k, v: (out token-major, lse)."""
    out, lse = attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), return_lse=True,
                                   **options)
    return out.transpose(1, 2), lse


def _check(out, lse, ref, ref_lse):
    assert out.shape == ref.shape
    assert (out.double() - ref).abs().max().item() <= TOL
    assert (lse.double() - ref_lse).abs().max().item() <= TOL


# 59 -> 64, 37 -> 40, 3 and 5 -> 8, 77 -> 80: head_dims the host targets build.
@pytest.mark.parametrize("head_dim", [3, 5, 37, 59, 77])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_pads_a_head_dim_that_is_not_a_multiple_of_8(host_build, head_dim, causal):
    q, k, v = _token_major(2, 33, 4, head_dim, 1), _token_major(2, 45, 2, head_dim, 2), _token_major(2, 45, 2, head_dim, 3)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    _check(out, lse, *_reference(q, k, v, is_causal=causal))
    assert flash_attn_func(q, k, v, causal=causal).shape == q.shape
    # An explicit scale is kept as given.
    out = flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal)
    assert (out.double() - _reference(q, k, v, is_causal=causal, softmax_scale=0.3)[0]).abs().max().item() <= TOL


def _misaligned(t: torch.Tensor, how: str) -> torch.Tensor:
    """t's values in rows the kernels cannot read as they are."""
    if how == "row stride":  # each row 3 elements past the last: strides not multiples of 8 elements
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype)
        wide[..., :t.shape[-1]] = t
        return wide[..., :t.shape[-1]]
    if how == "pointer":  # every stride a multiple of 8, the data 2 bytes past a 16-byte boundary
        flat = torch.zeros(t.numel() + 8, dtype=t.dtype)
        out = flat[1:1 + t.numel()].view(t.shape)
        out.copy_(t)
        return out
    assert how == "last dimension"  # not contiguous in its last dimension
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("how", ["row stride", "pointer", "last dimension"])
def test_flash_attn_func_copies_rows_it_cannot_read_as_they_are(host_build, how):
    q, k, v = (_token_major(1, 24, 2, 64, s) for s in (4, 5, 6))
    bad = _misaligned(k, how)
    assert torch.equal(bad, k) and (bad.stride() != k.stride() or bad.data_ptr() % 16)
    out, lse, _ = flash_attn_func(q, bad, v, causal=True, return_attn_probs=True)
    _check(out, lse, *_reference(q, k, v, is_causal=True))


def test_the_native_entry_points_copy_nothing(host_build):
    """flash_attn and scaled_dot_product_attention (the native layout) refuse, naming the problem."""
    q = torch.randn(1, 2, 16, 59).half()
    for entry in (flash_attn, scaled_dot_product_attention):
        with pytest.raises(InvalidArgumentError, match="head_dim 59 is not a multiple of 8: .* pad it with zero"):
            entry(q, q, q)
    wide = torch.randn(1, 2, 16, 67).half()[..., :64]  # rows 67 elements apart
    with pytest.raises(InvalidArgumentError, match="16-byte boundaries"):
        flash_attn(wide, wide, wide)


def test_flash_attn_func_refuses_what_padding_cannot_serve(host_build):
    q = _token_major(1, 8, 2, 260, 7)
    with pytest.raises(UnsupportedError, match="head_dim 260 is not a multiple of 8: head_dims up to 256"):
        flash_attn_func(q, q, q)
    q = _token_major(1, 8, 2, 59, 8)
    cos, sin = rotary_tables(8, 62)  # rotary_dim 62 fits the padded 64 columns, not the 59 given
    with pytest.raises(InvalidArgumentError, match="rotary_dim 62 .* exceeds head_dim 59"):
        flash_attn_func(q, q, q, rotary_cos=cos, rotary_sin=sin)
    # Inputs the entry point does not take at all keep its own errors.
    with pytest.raises(InvalidArgumentError, match="must be float16"):
        flash_attn_func(q.float(), q, q)
    with pytest.raises(InvalidArgumentError):  # head_dims that differ
        flash_attn_func(q, _token_major(1, 8, 2, 64, 9), _token_major(1, 8, 2, 64, 9))


def test_flash_attn_func_with_rope_rotates_the_columns_given(host_build):
    q, k, v = _token_major(1, 20, 2, 37, 10), _token_major(1, 20, 2, 37, 11), _token_major(1, 20, 2, 37, 12)
    cos, sin = rotary_tables(20, 36)
    out = flash_attn_func(q, k, v, causal=True, rotary_cos=cos, rotary_sin=sin)
    ref = _reference(q, k, v, is_causal=True, rotary_cos=cos, rotary_sin=sin)[0]
    assert (out.double() - ref).abs().max().item() <= TOL


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("head_dim", [37, 77])
def test_flash_attn_varlen_func_pads_the_head_dim(host_build, head_dim):
    lq, lk = (20, 3, 11), (30, 9, 11)
    q = torch.randn(sum(lq), 4, head_dim, generator=torch.Generator().manual_seed(13)).half()
    k = torch.randn(sum(lk), 2, head_dim, generator=torch.Generator().manual_seed(14)).half()
    v = torch.randn(sum(lk), 2, head_dim, generator=torch.Generator().manual_seed(15)).half()
    out, lse, _ = flash_attn_varlen_func(q, k, v, _cu(lq), _cu(lk), max(lq), max(lk), causal=True,
                                         return_attn_probs=True)
    assert out.shape == q.shape
    for b, (q0, k0) in enumerate(zip(_cu(lq)[:-1].tolist(), _cu(lk)[:-1].tolist())):
        qb, kb, vb = (t[None, s:s + n] for t, s, n in ((q, q0, lq[b]), (k, k0, lk[b]), (v, k0, lk[b])))
        ref, ref_lse = _reference(qb, kb, vb, is_causal=True, softmax_scale=1 / math.sqrt(head_dim))
        _check(out[q0:q0 + lq[b]][None], lse[:, q0:q0 + lq[b]][None], ref, ref_lse)


@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_with_kvcache_appends_to_the_callers_cache(host_build, paged):
    """head_dim 59: the call runs on padded copies of q, the cache and the new rows; the new keys and
    values land in the caller's cache, at cache_seqlens, as without padding."""
    b, cache, hk, d, new = 2, 64, 2, 59, 2
    q = _token_major(b, 1, 4, d, 16)
    k_cache, v_cache = _token_major(b, cache, hk, d, 17), _token_major(b, cache, hk, d, 18)
    k, v = _token_major(b, new, hk, d, 19), _token_major(b, new, hk, d, 20)
    lengths = torch.tensor([10, 40], dtype=torch.int32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i, n in enumerate(lengths.tolist()):
        want_k[i, n:n + new], want_v[i, n:n + new] = k[i], v[i]
    block_table = None
    kc, vc = k_cache, v_cache
    if paged:  # pages of 16 rows, the two sequences' pages interleaved in one pool
        block_table = torch.tensor([[0, 2, 4, 6], [1, 3, 5, 7]], dtype=torch.int32)
        kc, vc = (torch.stack([t[p % 2, 16 * (p // 2):16 * (p // 2) + 16] for p in range(8)]) for t in (k_cache, v_cache))
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, block_table=block_table, causal=True,
                                       return_softmax_lse=True)
    if paged:
        kc, vc = (torch.stack([torch.cat([t[p] for p in row]) for row in block_table.tolist()]) for t in (kc, vc))
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    for i, n in enumerate(lengths.tolist()):
        ref, ref_lse = _reference(q[i:i + 1], want_k[i:i + 1, :n + new], want_v[i:i + 1, :n + new], is_causal=True)
        _check(out[i:i + 1], lse[i:i + 1], ref, ref_lse)


def test_flash_attn_with_kvcache_copies_misaligned_queries_and_refuses_misaligned_caches(host_build):
    """As flash-attn's entry: q and the new rows are made readable by a copy; the cache, updated in
    place, is never copied to align it, so one that is not aligned is refused untouched."""
    b, cache, hk, d = 2, 32, 2, 64
    q = _token_major(b, 1, 4, d + 4, 24)[..., 2:d + 2]  # rows at 4-byte offsets
    k_cache, v_cache = _token_major(b, cache, hk, d, 25), _token_major(b, cache, hk, d, 26)
    lengths = torch.tensor([7, 30], dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    assert torch.equal(out, flash_attn_with_kvcache(q.contiguous(), k_cache, v_cache, cache_seqlens=lengths))
    strided = _token_major(b, cache, hk, d + 4, 27)[..., :d]
    before = strided.clone()
    with pytest.raises(InvalidArgumentError, match="v_cache rows must start on 16-byte boundaries"):
        flash_attn_with_kvcache(q, k_cache, strided, cache_seqlens=lengths)
    assert torch.equal(strided, before)


def test_the_padded_path_compiles_whole(host_build):
    """torch.compile traces the padding and the slice around the custom op, without graph breaks."""
    torch._dynamo.reset()
    q, k, v = _token_major(1, 16, 2, 59, 21), _token_major(1, 16, 2, 59, 22), _token_major(1, 16, 2, 59, 23)
    compiled = torch.compile(flash_attn_func, fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k, v, causal=True), flash_attn_func(q, k, v, causal=True))
