"""flash_attn_with_kvcache on the host platform: in-place append at cache_seqlens, RoPE on the new
keys and the queries at their positions, attention over each sequence's cache length, against the
float64 oracle on the cache as it should be after the append."""

import pytest
import torch

from rdnattention import attention_reference, flash_attn_with_kvcache, rotary_tables
from rdnattention.errors import InvalidArgumentError, UnsupportedError
from rdnattention.reference import rotate

TOL = 2e-3


def _setup(b=3, sq=1, new=1, hq=4, hk=2, d=64, cache=64, lengths=(10, 0, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).half()
    k_cache, v_cache = (torch.randn(b, cache, hk, d, generator=g).half() for _ in range(2))
    k, v = (torch.randn(b, new, hk, d, generator=g).half() for _ in range(2)) if new else (None, None)
    return q, k_cache, v_cache, k, v, torch.tensor(lengths, dtype=torch.int32)


def _expected(q, k_cache, v_cache, k, v, lengths, causal, window, rope):
    """The cache after the append and the oracle's output, batch by batch."""
    kc, vc = k_cache.clone(), v_cache.clone()
    outs, lses = [], []
    new = 0 if k is None else k.shape[1]
    for b, n in enumerate(lengths.tolist()):
        qb = q[b:b + 1].transpose(1, 2).double()
        if k is not None:
            kb = k[b:b + 1].transpose(1, 2).double()
            if rope is not None:
                cos, sin, inter = rope
                kb = rotate(kb, cos, sin, torch.arange(new) + n, inter)
                local = causal or window != (-1, -1)
                qpos = torch.arange(q.shape[1]) + n if local else torch.full((q.shape[1],), n)
                qb = rotate(qb, cos, sin, qpos, inter)
            kc[b, n:n + new] = kb[0].transpose(0, 1).half()
            vc[b, n:n + new] = v[b]
        used = n + new
        o, lse = attention_reference(qb.half(), kc[b:b + 1, :used].transpose(1, 2), vc[b:b + 1, :used].transpose(1, 2),
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


def test_an_int_length_and_the_whole_cache(host_build):
    q, k_cache, v_cache, _, _, _ = _setup(new=0)
    whole = flash_attn_with_kvcache(q, k_cache, v_cache)
    assert torch.equal(whole, flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=64))
    part = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=20)
    ref = attention_reference(q.transpose(1, 2), k_cache[:, :20].transpose(1, 2), v_cache[:, :20].transpose(1, 2))
    assert (part.double() - ref.transpose(1, 2)).abs().max().item() <= TOL


@pytest.mark.parametrize("kwargs, error, message", [
    ({"block_table": torch.zeros(3, 4, dtype=torch.int32)}, UnsupportedError, "block_table (paged KV)"),
    ({"cache_batch_idx": torch.arange(3)}, UnsupportedError, "cache_batch_idx is not implemented yet"),
    ({"num_splits": 4}, UnsupportedError, "num_splits=4: split-KV is not implemented yet"),
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
