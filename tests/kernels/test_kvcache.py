"""flash_attn_with_kvcache on the host platform: in-place append at cache_seqlens, RoPE on the new
keys and the queries at their positions, attention over each sequence's cache length, against the
float64 oracle on the cache as it should be after the append."""

import pytest
import torch

from rdnattention import attention_reference, flash_attn_with_kvcache, rotary_tables
from rdnattention.errors import InvalidArgumentError
from rdnattention.reference import rotate

TOL = 2e-3


def _setup(b=3, sq=1, new=1, hq=4, hk=2, d=64, cache=64, lengths=(10, 0, 40), seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k_cache, v_cache = (torch.randn(b, cache, hk, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, new, hk, d, generator=g).to(dtype) for _ in range(2)) if new else (None, None)
    return q, k_cache, v_cache, k, v, torch.tensor(lengths, dtype=torch.int32)


def _expected(q, k_cache, v_cache, k, v, lengths, causal, window, rope):
    """The cache after the append and the oracle's output, batch by batch."""
    kc, vc = k_cache.clone(), v_cache.clone()
    outs, lses = [], []
    new = 0 if k is None else k.shape[1]
    for b, n in enumerate(lengths.tolist()):
        qb = q[b:b + 1].transpose(1, 2)
        if k is not None:
            kb = k[b:b + 1].transpose(1, 2)
            if rope is not None:  # (16-bit in, 16-bit out: rounded once, as the append kernels round)
                cos, sin, inter = rope
                kb = rotate(kb, cos, sin, torch.arange(new) + n, inter)
                local = causal or window != (-1, -1)
                qpos = torch.arange(q.shape[1]) + n if local else torch.full((q.shape[1],), n)
                qb = rotate(qb, cos, sin, qpos, inter)
            kc[b, n:n + new] = kb[0].transpose(0, 1)
            vc[b, n:n + new] = v[b]
        used = n + new
        o, lse = attention_reference(qb, kc[b:b + 1, :used].transpose(1, 2), vc[b:b + 1, :used].transpose(1, 2),
                                     is_causal=causal, window_size=window, return_lse=True)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    return kc, vc, torch.cat(outs), torch.cat(lses)


# RoPE applies to the new keys (and q) only, so it is combined with appends only.
@pytest.mark.parametrize("sq, new, rope", [(1, 1, None), (4, 4, None), (1, 0, None), (3, 0, None),
                                           (1, 1, False), (1, 1, True), (4, 4, False), (4, 4, True)])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (8, 0))])
def test_matches_the_oracle_and_appends_in_place(host_build, sq, new, rope, causal, window):
    q, k_cache, v_cache, k, v, lengths = _setup(sq=sq, new=new)
    tables = None
    if rope is not None:
        cos, sin = rotary_tables(64, 32)
        tables = (cos, sin, rope)
    kc, vc, ref, ref_lse = _expected(q, k_cache, v_cache, k, v, lengths, causal, window, tables)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=tables and tables[0],
                                       rotary_sin=tables and tables[1], cache_seqlens=lengths, causal=causal,
                                       window_size=window, rotary_interleaved=bool(rope), return_softmax_lse=True)
    assert out.shape == q.shape
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
    assert (out.double() - ref).abs().max().item() <= TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= TOL


@pytest.mark.parametrize("sq, new, rope", [(1, 1, None), (4, 4, None), (1, 0, None), (1, 1, True), (4, 4, False)])
def test_bf16_matches_the_oracle_and_appends_in_place(host_build, sq, new, rope):
    """A bf16 cache with bf16 q, k, v: the append, RoPE and attention as in fp16, the output bf16
    within BF16_TOL and BF16_LSE_TOL (tests/cases.py: bf16's unit roundoff)."""
    from cases import BF16_LSE_TOL, BF16_TOL

    q, k_cache, v_cache, k, v, lengths = _setup(sq=sq, new=new, dtype=torch.bfloat16)
    tables = None
    if rope is not None:
        cos, sin = rotary_tables(64, 32)
        tables = (cos, sin, rope)
    kc, vc, ref, ref_lse = _expected(q, k_cache, v_cache, k, v, lengths, True, (-1, -1), tables)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=tables and tables[0],
                                       rotary_sin=tables and tables[1], cache_seqlens=lengths, causal=True,
                                       rotary_interleaved=bool(rope), return_softmax_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
    assert (out.double() - ref).abs().max().item() <= BF16_TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= BF16_LSE_TOL


@pytest.mark.parametrize("names, make", [
    ("k_cache is torch.bfloat16 but q is torch.float16", lambda q, kc, vc, k, v: (q, kc.bfloat16(), vc.bfloat16(), k, v)),
    ("v_cache is torch.bfloat16 but q is torch.float16", lambda q, kc, vc, k, v: (q, kc, vc.bfloat16(), k, v)),
    ("k is torch.bfloat16 but k_cache is torch.float16", lambda q, kc, vc, k, v: (q, kc, vc, k.bfloat16(), v.bfloat16())),
])
def test_mixed_dtypes_are_refused_naming_both_and_write_nothing(host_build, names, make):
    q, k_cache, v_cache, k, v = make(*_setup()[:5])
    saved = [t.clone() for t in (q, k_cache, v_cache, k, v)]
    with pytest.raises(InvalidArgumentError, match=names):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([10, 0, 40], dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip((q, k_cache, v_cache, k, v), saved))


def test_an_int_length_and_the_whole_cache(host_build):
    q, k_cache, v_cache, _, _, _ = _setup(new=0)
    whole = flash_attn_with_kvcache(q, k_cache, v_cache)
    assert torch.equal(whole, flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=64))
    part = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20)
    ref = attention_reference(q.transpose(1, 2), k_cache[:, :20].transpose(1, 2), v_cache[:, :20].transpose(1, 2))
    assert (part.double() - ref.transpose(1, 2)).abs().max().item() <= TOL


@pytest.mark.parametrize("kwargs, error, message", [
    ({"block_table": torch.zeros(3, 4, dtype=torch.int64)}, InvalidArgumentError, "block_table must be int32 2-D"),
    ({"block_table": torch.zeros(2, 4, dtype=torch.int32)}, InvalidArgumentError, "block_table has 2 rows"),
    ({"block_table": torch.zeros(3, 4, dtype=torch.int32), "cache_batch_idx": torch.zeros(3, dtype=torch.int32)},
     InvalidArgumentError, "cache_batch_idx and block_table exclude each other"),
    ({"cache_batch_idx": torch.arange(3)}, InvalidArgumentError, "cache_batch_idx must be int32 (3,)"),
    ({"cache_batch_idx": torch.tensor([0, 1, 3], dtype=torch.int32)}, InvalidArgumentError,
     "cache_batch_idx values must lie in [0, 2]"),
    ({"num_splits": -1}, InvalidArgumentError, "num_splits must be a non-negative int"),
    ({"cache_seqlens": torch.tensor([10, 0, 64], dtype=torch.int32)}, InvalidArgumentError,
     "cache_seqlens + seq_new (1) must lie in [0, cache_len = 64]"),
    ({"k": None}, InvalidArgumentError, "k and v must be given together"),
])
def test_what_is_refused(host_build, kwargs, error, message):
    q, k_cache, v_cache, k, v, lengths = _setup()
    args = {"k": k, "v": v, "cache_seqlens": lengths, **kwargs}
    with pytest.raises(error) as err:
        flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    assert message in str(err.value)


@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("causal", [False, True])
def test_a_paged_cache_is_the_contiguous_one_bit_for_bit(host_build, page, causal):
    """The same keys in shuffled pages of a pool: the same append (through the block table), the
    same output and LSE, bit for bit, as the contiguous cache with the same number of slices."""
    q, k_cache, v_cache, k, v, lengths = _setup(sq=2, new=2)
    b, cache, hk, d = k_cache.shape
    order = torch.randperm(b * cache // page, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    table = order.view(b, cache // page)
    pool_k = torch.zeros(b * cache // page, page, hk, d, dtype=k_cache.dtype)
    pool_v = torch.zeros_like(pool_k)
    pool_k[order.long()] = k_cache.reshape(-1, page, hk, d)
    pool_v[order.long()] = v_cache.reshape(-1, page, hk, d)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=causal, num_splits=2,
                                       return_softmax_lse=True)
    pout, plse = flash_attn_with_kvcache(q, pool_k, pool_v, k, v, cache_seqlens=lengths, block_table=table,
                                         causal=causal, num_splits=2, return_softmax_lse=True)
    assert torch.equal(pool_k[order.long()].reshape(k_cache.shape), k_cache)
    assert torch.equal(pool_v[order.long()].reshape(v_cache.shape), v_cache)
    assert torch.equal(pout, out) and torch.equal(plse, lse)
    _, _, ref, _ = _expected(q, k_cache, v_cache, None, None, lengths + 2, causal, (-1, -1), None)
    assert (pout.double() - ref).abs().max().item() <= TOL


def test_cache_batch_idx_picks_cache_rows(host_build):
    q, k_cache, v_cache, k, v, lengths = _setup()
    big_k = torch.randn(5, *k_cache.shape[1:]).half()
    big_v = torch.randn(5, *v_cache.shape[1:]).half()
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    big_k[idx.long()], big_v[idx.long()] = k_cache, v_cache
    untouched = big_k[[1, 3]].clone()
    out = flash_attn_with_kvcache(q, big_k, big_v, k, v, cache_seqlens=lengths, cache_batch_idx=idx)
    ref = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, num_splits=1)
    assert torch.equal(big_k[idx.long()], k_cache) and torch.equal(big_v[idx.long()], v_cache)
    assert torch.equal(big_k[[1, 3]], untouched)
    assert (out.double() - ref.double()).abs().max().item() <= TOL


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_num_splits_changes_only_the_rounding(host_build, num_splits):
    q, k_cache, v_cache, _, _, lengths = _setup(new=0, lengths=(64, 33, 1))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, num_splits=num_splits)
    _, _, ref, _ = _expected(q, k_cache, v_cache, None, None, lengths, False, (-1, -1), None)
    assert (out.double() - ref).abs().max().item() <= TOL
