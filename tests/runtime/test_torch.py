"""PyTorch integration on the host platform: the custom op (opcheck, torch.compile without graph
breaks), autograd refusal where the backward does not serve, flash-attn's token-major entry point, torch's SDPA semantics, fp16 RoPE
tables and the layout warning."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import rdnattention
from rdnattention import (attention_reference, flash_attn, flash_attn_func, rotary_tables,
                          scaled_dot_product_attention)
from rdnattention.errors import InvalidArgumentError, UnsupportedError

TOL = 2e-3


def _qkv(b=1, hq=4, hk=2, sq=40, sk=50, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, sq, d, generator=g).half(), torch.randn(b, hk, sk, d, generator=g).half(),
            torch.randn(b, hk, sk, d, generator=g).half())


def _err(out, ref):
    return (out.double() - ref).abs().max().item()


@pytest.mark.parametrize("token_major, return_lse", [(False, False), (False, True), (True, True)])
def test_opcheck(host_build, token_major, return_lse):
    q, k, v = _qkv()
    cos, sin = rotary_tables(50, 32)
    op = torch.ops.rdnattention.flash_attn_fwd.default
    for args in [(q, k, v, None, None, -1, 0, 0.125, False, return_lse, token_major),
                 (q, k, v, cos, sin, 20, -1, 0.1, True, return_lse, token_major)]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_compile_fullgraph_has_no_graph_break(host_build):
    q, k, v = _qkv()
    cos, sin = rotary_tables(50, 32)

    def layer(q, k, v):
        a = flash_attn(q, k, v, is_causal=True, rotary_cos=cos, rotary_sin=sin)
        b = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return a * 2 + b.transpose(1, 2)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    assert torch.equal(compiled(q, k, v), layer(q, k, v))
    explain = torch._dynamo.explain(layer)(q, k, v)
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_inputs_that_require_grad_are_refused_where_the_backward_does_not_serve(host_build):
    """ALiBi slopes that require grad get no gradient from the backward: refused, nothing written
    (tests/kernels/test_backward.py has the rest)."""
    q, k, v = _qkv()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)
    before = [t.clone() for t in (q, k, v, slopes.detach())]
    with pytest.raises(UnsupportedError, match="alibi_slopes requires grad, and the backward pass gives no gradient"):
        flash_attn(q, k, v, alibi_slopes=slopes)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, slopes.detach()), before))
    with torch.no_grad():
        out = flash_attn(q, k, v, alibi_slopes=slopes)
    with torch.inference_mode():
        assert torch.equal(flash_attn(q, k, v, alibi_slopes=slopes), out)


def test_flash_attn_func_is_token_major(host_build):
    q, k, v = _qkv(sq=33, sk=70)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    out, lse, probs = flash_attn_func(qt, kt, vt, causal=True, window_size=(20, 0), return_attn_probs=True)
    ref, ref_lse = attention_reference(q, k, v, is_causal=True, window_size=(20, 0), return_lse=True)
    assert out.shape == qt.shape and out.is_contiguous() and probs is None
    assert _err(out.transpose(1, 2), ref) <= TOL and _err(lse, ref_lse) <= TOL
    assert torch.equal(flash_attn_func(qt, kt, vt, softmax_scale=0.2), flash_attn(q, k, v, softmax_scale=0.2).transpose(1, 2))


@pytest.mark.parametrize("kwargs, message", [
    ({"dropout_p": 0.1}, "dropout_p=0.1: the kernels have no attention dropout"),
])
def test_flash_attn_func_refuses_what_it_lacks(host_build, kwargs, message):
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    with pytest.raises(UnsupportedError, match=message):
        flash_attn_func(q, k, v, **kwargs)


@pytest.mark.parametrize("sq, sk, hk", [(40, 50, 4), (50, 40, 4), (37, 37, 2), (1, 30, 1), (30, 1, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_matches_torch(host_build, sq, sk, hk, causal):
    q, k, v = _qkv(hk=hk, sq=sq, sk=sk)
    gqa = hk != q.shape[1]
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, scale=0.11,
                                         enable_gqa=gqa)
    out = scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.11, enable_gqa=gqa)
    assert _err(out, ref) <= TOL


@pytest.mark.parametrize("entry", ["flash_attn", "flash_attn_func"])
def test_flash_attn_express_serves_only_the_options_it_was_made_under(host_build, entry):
    """flash_attn's and flash_attn_func's express functions (made by a geometry's fourth call, tried
    before the key) serve only a call with the options they were made under: the same tensors with
    another causal flag, window, scale or softcap, asking for the LSE, or with dropout get their own
    results and errors."""
    from rdnattention import api
    q, k, v = _qkv(sq=40, sk=50)
    if entry == "flash_attn":
        call, express, causal = flash_attn, api._flash_express, "is_causal"
        lse_kw, args = dict(return_lse=True), (q, k, v)
    else:
        call, express, causal = flash_attn_func, api._func_express, "causal"
        lse_kw, args = dict(return_attn_probs=True), tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))
    base = {causal: True, "softcap": 5.0}
    for kw in [{causal: True}, {causal: False, "softcap": 5.0}, dict(base, window_size=(7, 3)),
               dict(base, softmax_scale=0.11), dict(base, softcap=5), base]:
        for one in (base,) * 4 + (kw,):  # the express made for base's options, then a call of kw's
            assert express.made or one is base  # made by the fourth call of base's
            out = call(*args, **one)
            ref = attention_reference(q, k, v, is_causal=one.get(causal, False),
                                      window_size=one.get("window_size", (-1, -1)),
                                      softmax_scale=one.get("softmax_scale"), softcap=one.get("softcap", 0.0))
            assert _err(out if entry == "flash_attn" else out.transpose(1, 2), ref) <= TOL, one
    call(*args, **base)
    assert express.made
    out, lse = call(*args, **base, **lse_kw)[:2]
    assert lse.shape == (1, 4, 40) and torch.equal(out, call(*args, **base))
    if entry == "flash_attn_func":
        with pytest.raises(UnsupportedError):
            call(*args, 0.5, causal=True)


def test_sdpa_express_serves_only_the_options_it_was_made_under(host_build):
    """Repeated calls of one geometry go through the replay's express function (from the fourth),
    tried before the checks its guard stands for, and only for a call with the options it was made
    under: the same tensors with another is_causal, scale or enable_gqa get their own outputs and
    errors."""
    from rdnattention import api
    q, k, v = _qkv(hk=2, sq=40, sk=40)
    base = dict(is_causal=True, enable_gqa=True)
    for kw in [dict(is_causal=False, enable_gqa=True), dict(base, scale=0.11), base]:
        for one in (base,) * 4 + (kw,):  # the express made for base's options, then a call of kw's
            assert api._sdpa_express.made or one is base  # made by the fourth call of base's
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **one)
            assert _err(scaled_dot_product_attention(q, k, v, **one), ref) <= TOL
    with pytest.raises(InvalidArgumentError, match="pass enable_gqa=True"):
        scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.raises(InvalidArgumentError):
        scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=torch.tensor([0.1, 0.2]))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"attn_mask": torch.ones(40, 50, dtype=torch.bool)}, UnsupportedError, "attn_mask: arbitrary masks"),
    ({"dropout_p": 0.5}, UnsupportedError, "dropout_p=0.5"),
    ({}, InvalidArgumentError, "query has 4 heads and key 2: pass enable_gqa=True"),
])
def test_sdpa_refuses_what_it_lacks(host_build, kwargs, error, message):
    q, k, v = _qkv()
    with pytest.raises(error, match=message):
        scaled_dot_product_attention(q, k, v, **kwargs)


def test_rotary_tables_in_q_dtype(host_build):
    q, k, v = _qkv()
    cos, sin = rotary_tables(50, 64)
    half = flash_attn(q, k, v, rotary_cos=cos.half(), rotary_sin=sin.half(), rotary_interleaved=True)
    ref = attention_reference(q, k, v, rotary_cos=cos.half().float(), rotary_sin=sin.half().float(),
                              rotary_interleaved=True)
    assert _err(half, ref) <= TOL


def test_token_major_input_to_the_native_entry_warns_once(host_build, monkeypatch):
    monkeypatch.setattr(rdnattention.api, "_warned_layout", False)
    q = torch.randn(1, 2, 513, 64).half().transpose(1, 2)  # [b, s, h, d] passed as [b, h, s, d]: 513 heads
    with pytest.warns(UserWarning, match="use rdnattention.flash_attn_func for that layout"):
        flash_attn(q, q, q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attn(q, q, q)


def test_repeated_calls_replay_the_plan_and_still_check_every_argument(host_build):
    from rdnattention import replay
    q, k, v = _qkv(sq=20, sk=20)
    replay.clear()
    first = flash_attn(q, k, v, is_causal=True)
    assert len(replay.cache) == 1
    again, lse = flash_attn(q.clone(), k.clone(), v.clone(), is_causal=True, return_lse=True)
    assert torch.equal(again, first) and len(replay.cache) == 2
    assert torch.equal(flash_attn(q, k, v, is_causal=True), first)
    with pytest.raises(InvalidArgumentError, match="is_causal must be a bool"):
        flash_attn(q, k, v, is_causal=1)  # equal to True as a key, but not a bool
    with pytest.raises(InvalidArgumentError, match="window_size must be a pair of ints"):
        flash_attn(q, k, v, window_size=(True, -1))
    buf = torch.zeros(q.numel() + 8, dtype=torch.float16)
    shifted = buf[4:4 + q.numel()].view(q.shape)  # same shape and strides, pointer 8 bytes off
    shifted.copy_(q)
    with pytest.raises(InvalidArgumentError, match="rows must start on 16-byte boundaries"):
        flash_attn(shifted, k, v, is_causal=True)


def test_decode_op_opcheck(host_build):
    q, k, v = (t.transpose(1, 2).contiguous() for t in _qkv(b=2, sq=1, sk=60))
    lengths = torch.tensor([60, 17], dtype=torch.int32)
    op = torch.ops.rdnattention.flash_attn_decode_fwd.default
    for splits, lse in ((0, True), (3, False)):
        args = (q, k, v, lengths, None, None, None, None, 2, 1, 60, -1, 0, 0.125, lse, splits)
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_cache_and_packed_entry_points_compile_without_a_break(host_build):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 4, 64, generator=g).half()
    pool_k, pool_v = (torch.randn(8, 16, 2, 64, generator=g).half() for _ in range(2))
    table = torch.tensor([[3, 1, 4, 0], [7, 6, 5, 2]], dtype=torch.int32)
    lengths = torch.tensor([50, 9], dtype=torch.int32)
    packed_q = torch.randn(5, 4, 64, generator=g).half()
    packed_k, packed_v = (torch.randn(70, 2, 64, generator=g).half() for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 1, 5], dtype=torch.int32), torch.tensor([0, 30, 70], dtype=torch.int32)

    def step(q, pool_k, pool_v, packed_q, packed_k, packed_v):
        a = rdnattention.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lengths, block_table=table)
        b = rdnattention.varlen_attn(packed_q, packed_k, packed_v, cu_q, cu_k, 4, 40, enable_gqa=True,
                                     window_size=(-1, 0))
        return a.sum() + b.sum()

    args = (q, pool_k, pool_v, packed_q, packed_k, packed_v)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(step)(*args)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(*args), step(*args))


def test_kvcache_op_opcheck(host_build):
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 1, 4, 64, generator=g).half()
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, generator=g).half() for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 64, generator=g).half() for _ in range(2))
    cos, sin = rotary_tables(64, 32)
    lengths = torch.tensor([10, 40], dtype=torch.int32)
    op = torch.ops.rdnattention.flash_attn_kvcache_fwd.default
    for tables, lse, splits in (((None, None), True, 0), ((cos, sin), False, 2)):
        args = (q, k_cache, v_cache, k, v, *tables, lengths, None, None, -1, 0, 0.125, True, True, lse, splits)
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("paged", [False, True])
def test_a_compiled_append_matches_eager_and_appends_once(host_build, paged):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 2, 4, 64, generator=g).half()
    k, v = (torch.randn(2, 2, 2, 64, generator=g).half() for _ in range(2))
    lengths = torch.tensor([50, 9], dtype=torch.int32)
    cos, sin = rotary_tables(64, 32)
    table = torch.tensor([[3, 1, 4, 0], [7, 6, 5, 2]], dtype=torch.int32) if paged else None
    shape = (8, 16, 2, 64) if paged else (2, 64, 2, 64)
    caches = [torch.randn(shape, generator=g).half() for _ in range(2)]
    eager_caches = [c.clone() for c in caches]

    def step(q, k_cache, v_cache, k, v, lengths):
        return rdnattention.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                                    cache_seqlens=lengths, block_table=table, causal=True,
                                                    return_softmax_lse=True)

    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *caches, k, v, lengths)
    ref, ref_lse = step(q, *eager_caches, k, v, lengths)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert all(torch.equal(a, b) for a, b in zip(caches, eager_caches))
