"""flash-attn's signatures, whole, on the host platform: flash_attn_with_kvcache's full parameter
list in flash-attn's order (positional arguments bind as in flash-attn; its keywords at their
defaults are accepted), cache_leftpad against the float64 oracle, window_size as a tensor pair,
the packed entry points (views of the packed tensor: the same bits as the unpacked call), and
errors in the caller's argument names."""

import inspect

import pytest
import torch

import rdnattention
from rdnattention import (attention_reference, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                          flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                          flash_attn_with_kvcache, padding, rotary_tables)
from rdnattention.errors import InvalidArgumentError, UnsupportedError
from rdnattention.reference import rotate

TOL = 2e-3

# flash-attn's parameters (flash_attn/flash_attn_interface.py), in order, with their defaults.
_COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
           ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
_NO_DEFAULT = inspect.Parameter.empty
FLASH_ATTN = {
    "flash_attn_with_kvcache": [
        ("q", _NO_DEFAULT), ("k_cache", _NO_DEFAULT), ("v_cache", _NO_DEFAULT), ("k", None), ("v", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
        ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
        ("num_splits", 0), ("return_softmax_lse", False)],
    "flash_attn_func": [("q", _NO_DEFAULT), ("k", _NO_DEFAULT), ("v", _NO_DEFAULT), *_COMMON],
    "flash_attn_qkvpacked_func": [("qkv", _NO_DEFAULT), *_COMMON],
    "flash_attn_kvpacked_func": [("q", _NO_DEFAULT), ("kv", _NO_DEFAULT), *_COMMON],
    "flash_attn_varlen_func": [(n, _NO_DEFAULT) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                                           "max_seqlen_q", "max_seqlen_k")]
                              + _COMMON + [("block_table", None)],
    "flash_attn_varlen_qkvpacked_func": [("qkv", _NO_DEFAULT), ("cu_seqlens", _NO_DEFAULT),
                                         ("max_seqlen", _NO_DEFAULT), *_COMMON],
    "flash_attn_varlen_kvpacked_func": [(n, _NO_DEFAULT) for n in ("q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                                                    "max_seqlen_q", "max_seqlen_k")] + _COMMON,
}


@pytest.mark.parametrize("name", list(FLASH_ATTN))
def test_positional_parameters_are_flash_attns_in_its_order(name):
    params = [p for p in inspect.signature(getattr(rdnattention, name)).parameters.values()
              if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]  # keyword-only extras (RoPE) follow
    assert [(p.name, p.default) for p in params] == FLASH_ATTN[name]


def _setup(b=3, sq=1, new=1, hq=4, hk=2, d=64, cache=64, lengths=(10, 20, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).half()
    k_cache, v_cache = (torch.randn(b, cache, hk, d, generator=g).half() for _ in range(2))
    k, v = (torch.randn(b, new, hk, d, generator=g).half() for _ in range(2)) if new else (None, None)
    return q, k_cache, v_cache, k, v, torch.tensor(lengths, dtype=torch.int32)


def test_every_flash_attn_keyword_at_its_default_and_positional_binding(host_build):
    q, k_cache, v_cache, k, v, lengths = _setup(sq=2, new=2)
    cos, sin = rotary_tables(64, 32)
    kc1, vc1, kc2, vc2 = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    # flash-attn's 19 parameters, positionally, in its order
    out1, lse1 = flash_attn_with_kvcache(q, kc1, vc1, k, v, cos, sin, lengths, None, None, None, 0.125, True, (-1, -1),
                                         0.0, False, None, 0, True)
    out2, lse2 = flash_attn_with_kvcache(q, kc2, vc2, k=k, v=v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths,
                                         cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                         softmax_scale=0.125, causal=True, window_size=(-1, -1), softcap=0.0, rotary_interleaved=False,
                                         alibi_slopes=None, num_splits=0, return_softmax_lse=True)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    assert not torch.equal(kc1, k_cache)  # appended


@pytest.mark.parametrize("kwargs, error, message", [
    ({"cache_leftpad": torch.zeros(3, dtype=torch.int64)}, InvalidArgumentError, "cache_leftpad must be int32 (3,)"),
    ({"cache_leftpad": torch.tensor([0, 21, 0], dtype=torch.int32)}, InvalidArgumentError,
     "cache_leftpad must not exceed cache_seqlens"),
    ({"cache_leftpad": torch.tensor([-1, 0, 0], dtype=torch.int32)}, InvalidArgumentError,
     "cache_leftpad values must lie in [0, 64]"),
    ({"cache_leftpad": torch.zeros(3, dtype=torch.int32), "cache_batch_idx": torch.arange(3, dtype=torch.int32)},
     UnsupportedError, "cache_leftpad with cache_batch_idx"),
    ({"causal": 1}, InvalidArgumentError, "causal must be a bool, got 1"),
    ({"return_softmax_lse": 0}, InvalidArgumentError, "return_softmax_lse must be a bool, got 0"),
    ({"window_size": torch.tensor([4.0, 0.0])}, InvalidArgumentError, "window_size must be a pair of ints"),
    ({"window_size": torch.tensor([4, 0], device="meta")}, UnsupportedError, "window_size is a tensor on meta"),
])
def test_what_is_refused_leaves_the_cache_as_it_was(host_build, kwargs, error, message):
    q, k_cache, v_cache, k, v, lengths = _setup()
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(error) as err:
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, **kwargs)
    assert message in str(err.value)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_cache_leftpad_with_a_block_table_is_refused_naming_both(host_build):
    q, _, _, k, v, lengths = _setup()
    pool = torch.zeros(12, 16, 2, 64, dtype=torch.float16)
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    with pytest.raises(UnsupportedError, match="cache_leftpad with block_table"):
        flash_attn_with_kvcache(q, pool, pool.clone(), k, v, cache_seqlens=lengths, block_table=table,
                                cache_leftpad=torch.zeros(3, dtype=torch.int32))


def _leftpad_expected(q, k_cache, v_cache, k, v, lengths, leftpad, causal, window, rope):
    """The cache after the append, and the oracle over keys cache_leftpad .. cache_seqlens + seq_new - 1."""
    kc, vc = k_cache.clone(), v_cache.clone()
    new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for b, (n, lp) in enumerate(zip(lengths.tolist(), leftpad.tolist())):
        qb = q[b:b + 1].transpose(1, 2)
        if k is not None:
            kb = k[b:b + 1].transpose(1, 2)
            if rope is not None:  # positions in the cache, as without left padding (16-bit: rounded once)
                cos, sin, inter = rope
                kb = rotate(kb, cos, sin, torch.arange(new) + n, inter)
                local = causal or window != (-1, -1)
                qb = rotate(qb, cos, sin, torch.arange(q.shape[1]) + n if local else torch.full((q.shape[1],), n),
                            inter)
            kc[b, n:n + new] = kb[0].transpose(0, 1)
            vc[b, n:n + new] = v[b]
        keys = slice(lp, n + new)
        o, lse = attention_reference(qb, kc[b:b + 1, keys].transpose(1, 2), vc[b:b + 1, keys].transpose(1, 2),
                                     is_causal=causal, window_size=window, return_lse=True)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    return kc, vc, torch.cat(outs), torch.cat(lses)


# Sequence 1's keys start at its cache length: with no new keys it sees none.
@pytest.mark.parametrize("sq, new, rope", [(1, 1, None), (4, 4, None), (1, 0, None), (3, 0, None), (1, 1, True),
                                           (4, 4, False), (72, 0, None)])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (8, 0))])
def test_cache_leftpad_matches_the_oracle(host_build, sq, new, rope, causal, window):
    q, k_cache, v_cache, k, v, lengths = _setup(sq=sq, new=new)
    leftpad = torch.tensor([3, 20, 0], dtype=torch.int32)
    tables = None
    if rope is not None:
        cos, sin = rotary_tables(128, 32)
        tables = (cos, sin, rope)
    kc, vc, ref, ref_lse = _leftpad_expected(q, k_cache, v_cache, k, v, lengths, leftpad, causal, window, tables)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=tables and tables[0],
                                       rotary_sin=tables and tables[1], cache_seqlens=lengths, cache_leftpad=leftpad,
                                       causal=causal, window_size=window, rotary_interleaved=bool(rope),
                                       return_softmax_lse=True)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
    assert out.shape == q.shape and lse.shape == (3, 4, sq) and lse.is_contiguous()
    assert (out.double() - ref).abs().max().item() <= TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= TOL


def test_cache_leftpad_of_zeros_is_the_call_without_it(host_build):
    q, k_cache, v_cache, _, _, lengths = _setup(sq=2, new=0)
    plain = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    padded = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True,
                                     cache_leftpad=torch.zeros(3, dtype=torch.int32))
    assert (plain.double() - padded.double()).abs().max().item() <= TOL


@pytest.mark.parametrize("window", [torch.tensor([5, 0]), [5, 0], (torch.tensor(5), torch.tensor(0)),
                                    torch.tensor([5, 0], dtype=torch.int32)],
                         ids=["tensor", "list", "0-d tensors", "int32 tensor"])
def test_window_size_as_flash_attns_tests_pass_it(host_build, window):
    q, k_cache, v_cache, _, _, lengths = _setup(sq=3, new=0)
    expected = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, window_size=(5, 0))
    assert torch.equal(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, window_size=window),
                       expected)
    qf, kf, vf = (torch.randn(2, 12, 2, 64).half() for _ in range(3))
    assert torch.equal(flash_attn_func(qf, kf, vf, window_size=window), flash_attn_func(qf, kf, vf, window_size=(5, 0)))


# --- the packed entry points -----------------------------------------------------------------------


@pytest.fixture
def no_copies(monkeypatch):
    """Calls whose packed tensors the kernels read as they are: padding.run (the copying path) never runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("a packed tensor was copied")
    monkeypatch.setattr(padding, "run", refuse)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (3, 2))])
def test_qkvpacked_and_kvpacked_are_the_unpacked_calls(host_build, no_copies, causal, window):
    torch.manual_seed(0)
    qkv = torch.randn(2, 10, 3, 4, 64).half()
    got = flash_attn_qkvpacked_func(qkv, causal=causal, window_size=window, return_attn_probs=True)
    want = flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal, window_size=window,
                           return_attn_probs=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] is None
    ref = attention_reference(*(qkv[:, :, i].transpose(1, 2) for i in range(3)), is_causal=causal,
                              window_size=window)
    assert (got[0].double() - ref.transpose(1, 2)).abs().max().item() <= TOL
    q, kv = torch.randn(2, 6, 4, 64).half(), torch.randn(2, 10, 2, 2, 64).half()  # GQA: 4 heads on 2
    got = flash_attn_kvpacked_func(q, kv, causal=causal, window_size=window)
    assert torch.equal(got, flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=causal, window_size=window))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_packed_forms_are_flash_attn_varlen_func(host_build, no_copies, causal):
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 5, 17], dtype=torch.int32)
    qkv = torch.randn(17, 3, 4, 64).half()
    got = flash_attn_varlen_qkvpacked_func(qkv, cu, 12, causal=causal, return_attn_probs=True)
    want = flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, 12, 12, causal=causal,
                                  return_attn_probs=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] is None
    q, kv = torch.randn(7, 4, 64).half(), torch.randn(17, 2, 2, 64).half()
    cu_q = torch.tensor([0, 1, 3, 7], dtype=torch.int32)
    got = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu, 4, 12, causal=causal)
    assert torch.equal(got, flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_q, cu, 4, 12, causal=causal))


def test_a_head_dim_of_no_multiple_of_8_is_padded_as_flash_attn_does(host_build):
    torch.manual_seed(0)
    qkv = torch.randn(2, 9, 3, 2, 36).half()
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    ref = attention_reference(*(qkv[:, :, i].transpose(1, 2) for i in range(3)), is_causal=True)
    assert out.shape == (2, 9, 2, 36)
    assert (out.double() - ref.transpose(1, 2)).abs().max().item() <= TOL


@pytest.mark.parametrize("call, message", [
    (lambda: flash_attn_qkvpacked_func(torch.zeros(2, 8, 2, 4, 64).half()), "qkv must be 5-D [batch, seq, 3"),
    (lambda: flash_attn_qkvpacked_func(torch.zeros(2, 8, 3, 4, 64)), "qkv must be float16"),
    (lambda: flash_attn_qkvpacked_func(torch.zeros(2, 8, 3, 4, 64).half(), causal=None), "causal must be a bool"),
    (lambda: flash_attn_kvpacked_func(torch.zeros(2, 8, 4, 64).half(), torch.zeros(2, 8, 3, 4, 64).half()),
     "kv must be 5-D [batch, seq_k, 2"),
    (lambda: flash_attn_kvpacked_func(torch.zeros(2, 8, 4, 64).half(), torch.zeros(3, 8, 2, 4, 64).half()),
     "kv shape (3, 8, 2, 4, 64) does not match q shape"),
    (lambda: flash_attn_kvpacked_func(torch.zeros(2, 8, 3, 64).half(), torch.zeros(2, 8, 2, 2, 64).half()),
     "q heads (3) must be a multiple of kv heads (2)"),
    (lambda: flash_attn_varlen_qkvpacked_func(torch.zeros(8, 3, 4, 64).half(), torch.tensor([0, 8]), 8),
     "cu_seqlens must be int32"),
    (lambda: flash_attn_varlen_qkvpacked_func(torch.zeros(8, 3, 4, 64).half(),
                                              torch.tensor([0, 8], dtype=torch.int32), 4),
     "longer than max_seqlen = 4"),
    (lambda: flash_attn_varlen_qkvpacked_func(torch.zeros(8, 3, 4, 64), torch.tensor([0, 8], dtype=torch.int32), 8),
     "qkv must be float16"),
    (lambda: flash_attn_varlen_kvpacked_func(torch.zeros(8, 4, 64).half(), torch.zeros(8, 3, 4, 64).half(),
                                             torch.tensor([0, 8], dtype=torch.int32),
                                             torch.tensor([0, 8], dtype=torch.int32), 8, 8),
     "kv must be 4-D [total_k, 2"),
    (lambda: flash_attn_varlen_func(torch.zeros(8, 4, 64).half(), torch.zeros(8, 4, 64).half(),
                                    torch.zeros(8, 4, 64).half(), torch.tensor([0, 8], dtype=torch.int32),
                                    torch.tensor([0, 8]), 8, 8), "cu_seqlens_k must be int32"),
    (lambda: flash_attn_varlen_func(torch.zeros(8, 4, 64).half(), torch.zeros(8, 4, 64).half(),
                                    torch.zeros(8, 4, 64).half(), torch.tensor([0, 8], dtype=torch.int32),
                                    torch.tensor([0, 8], dtype=torch.int32), -1, 8), "max_seqlen_q must be"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_errors_name_the_callers_arguments(host_build, call, message):
    with pytest.raises(InvalidArgumentError) as err:
        call()
    assert message in str(err.value)


def test_block_table_bounds_errors_name_it(host_build):
    q, _, _, k, v, lengths = _setup()
    pool_k, pool_v = (torch.zeros(12, 16, 2, 64, dtype=torch.float16) for _ in range(2))
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 12]], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match=r"block_table values must lie in \[0, 11\]"):
        flash_attn_with_kvcache(q, pool_k, pool_v, k, v, cache_seqlens=lengths, block_table=table)
    assert not pool_k.any()
    with pytest.raises(RuntimeError, match="block_table"):  # what flash-attn raises for it, and callers catch
        flash_attn_with_kvcache(q, pool_k, pool_v, k, v, cache_seqlens=lengths, block_table=table)
    q1 = torch.zeros(3, 4, 64).half()
    cu_q = torch.arange(4, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="block_table values must lie in"):
        flash_attn_varlen_func(q1, pool_k, pool_v, cu_q, torch.tensor([0, 10, 20, 30], dtype=torch.int32), 1, 64,
                               block_table=table)
    with pytest.raises(InvalidArgumentError, match="block_table's pages per sequence"):
        flash_attn_varlen_func(q1, pool_k, pool_v, cu_q, torch.tensor([0, 10, 20, 95], dtype=torch.int32), 1, 64,
                               block_table=table.clamp(max=11))


@pytest.mark.parametrize("append", [False, True])
def test_paged_cache_capacity_errors_name_block_table(host_build, append):
    """With a paged cache, cache_seqlens (+ the appended keys) are bounded by the pages the block
    table gives each sequence, and the refusal says so (flash-attn's own test of this bound looks
    for "block_table" in the message); nothing is written."""
    q, _, _, k, v, _ = _setup(b=1, new=1 if append else 0)
    pool_k, pool_v = (torch.randn(4, 16, 2, 64).half() for _ in range(2))
    before = pool_k.clone(), pool_v.clone()
    table = torch.zeros(1, 1, dtype=torch.int32)
    lengths = torch.tensor([16 if append else 17], dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match=r"must lie in \[0, block_table's pages per sequence \* "
                                                   r"page_size = 16\]"):
        flash_attn_with_kvcache(q, pool_k, pool_v, k, v, cache_seqlens=lengths, block_table=table)
    assert torch.equal(pool_k, before[0]) and torch.equal(pool_v, before[1])
    out = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=torch.tensor([16], dtype=torch.int32),
                                  block_table=table)
    assert out.shape == q.shape and not out.isnan().any()


@pytest.mark.parametrize("append", [False, True])
def test_cache_leftpad_compiles_whole_and_matches_eager(host_build, append):
    q, k_cache, v_cache, k, v, lengths = _setup(sq=2, new=2 if append else 0)
    leftpad = torch.tensor([3, 7, 0], dtype=torch.int32)
    cos, sin = rotary_tables(64, 32) if append else (None, None)
    caches, eager_caches = [k_cache, v_cache], [k_cache.clone(), v_cache.clone()]

    def step(q, k_cache, v_cache, k, v, lengths, leftpad):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, lengths, None, leftpad, causal=True,
                                       return_softmax_lse=True)

    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *caches, k, v, lengths, leftpad)
    ref, ref_lse = step(q, *eager_caches, k, v, lengths, leftpad)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert all(torch.equal(a, b) for a, b in zip(caches, eager_caches))
