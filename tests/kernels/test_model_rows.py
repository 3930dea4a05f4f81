"""The attention of the models that need a score transform, at the shapes their configs give (heads,
K/V heads, head_dim, softmax scale, softcap, sliding window, ALiBi slopes), through the
flash-attn-compatible entry points (prefill, packed batches, a KV cache with decode and chunked
prefill, paged and split), against the float64 oracle on the host emulator:

- Gemma 2 (gemma-2-2b): 8 query heads, 4 K/V heads, head_dim 256, scale query_pre_attn_scalar^-1/2
  = 256^-1/2, attn_logit_softcapping 50, sliding_window 4096 on alternate layers;
- gpt-oss (gpt-oss-20b): 64 query heads, 8 K/V heads, head_dim 64, a learned sink per query head,
  sliding_window 128 on alternate layers;
- ALiBi: Bloom (bloom-560m: 16 heads of 64), MPT (mpt-7b: 32 heads of 128, alibi_bias_max 8),
  Baichuan (Baichuan-13B: 40 heads of 128, slopes for a head count that is not a power of two)."""

import math

import pytest
import torch

from rdnattention import (attention_reference, flash_attn_func, flash_attn_varlen_func,
                          flash_attn_with_kvcache)

TOL = 2e-3


def _err(out, ref):
    return (out.double() - ref).abs().max().item()


def _tensors(batch, heads_q, heads_kv, seq_q, seq_k, head_dim, seed, q_gain=1.0):
    """q [batch, seq_q, heads_q, head_dim] and k, v [batch, seq_k, heads_kv, head_dim] (token-major)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, seq_q, heads_q, head_dim, generator=g) * q_gain).half()
    k = torch.randn(batch, seq_k, heads_kv, head_dim, generator=g).half()
    v = torch.randn(batch, seq_k, heads_kv, head_dim, generator=g).half()
    return q, k, v


def _native(*ts):
    return [t.transpose(1, 2) for t in ts]


def alibi_slopes(heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """ALiBi's slopes (Press et al.; Bloom's build_alibi_tensor, MPT's gen_slopes with alibi_bias_max
    8, Baichuan's): 2^(-bias_max * i / n) for i = 1..n with n the largest power of two up to heads,
    and for the heads beyond it the odd steps of the slopes of 2n heads."""
    n = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-bias_max * i / n) for i in range(1, n + 1)]
    extra = [2.0 ** (-bias_max * i / (2 * n)) for i in range(1, 2 * n + 1, 2)]
    return torch.tensor(slopes + extra[:heads - n], dtype=torch.float32)


# --- Gemma 2 -------------------------------------------------------------------------------------

GEMMA2 = dict(heads_q=8, heads_kv=4, head_dim=256, scale=256 ** -0.5, softcap=50.0, sliding_window=4096)


def test_gemma2_prefill_global_and_sliding_layers(host_build):
    c = GEMMA2
    # q scaled so that scores reach the cap's bend (tanh(s / 50) departs from s / 50 beyond ~10)
    q, k, v = _tensors(2, c["heads_q"], c["heads_kv"], 160, 160, c["head_dim"], seed=0, q_gain=4.0)
    for window in ((-1, -1), (c["sliding_window"] - 1, 0), (47, 0)):  # global; the config's; one that bites
        out, lse, _ = flash_attn_func(q, k, v, softmax_scale=c["scale"], causal=True, window_size=window,
                                      softcap=c["softcap"], return_attn_probs=True)
        ref, ref_lse = attention_reference(*_native(q, k, v), is_causal=True, window_size=window,
                                           softmax_scale=c["scale"], softcap=c["softcap"], return_lse=True)
        assert _err(out.transpose(1, 2), ref) <= TOL and _err(lse, ref_lse) <= TOL
    uncapped = attention_reference(*_native(q, k, v), is_causal=True, softmax_scale=c["scale"])
    assert _err(out.transpose(1, 2), uncapped) > 20 * TOL  # the cap changed the result


@pytest.mark.parametrize("seq_q", [1, 16])  # decode, and a chunk of a chunked prefill
def test_gemma2_sliding_layer_on_a_cache_longer_than_its_window(host_build, seq_q):
    c = GEMMA2
    cache = c["sliding_window"] + 100
    q, k, v = _tensors(1, c["heads_q"], c["heads_kv"], seq_q, cache, c["head_dim"], seed=1, q_gain=4.0)
    window = (c["sliding_window"] - 1, 0)
    out, lse = flash_attn_with_kvcache(q, k, v, softmax_scale=c["scale"], causal=True, window_size=window,
                                       return_softmax_lse=True, softcap=c["softcap"])
    ref, ref_lse = attention_reference(*_native(q, k, v), is_causal=True, window_size=window,
                                       softmax_scale=c["scale"], softcap=c["softcap"], return_lse=True)
    assert _err(out.transpose(1, 2), ref) <= TOL and _err(lse, ref_lse) <= TOL


# --- gpt-oss -------------------------------------------------------------------------------------

GPT_OSS = dict(heads_q=64, heads_kv=8, head_dim=64, sliding_window=128)


def _sinks(heads, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, generator=g) * 2 + 2).float()  # of the rows' log-sum-exps' size


@pytest.mark.parametrize("window", [(-1, -1), (GPT_OSS["sliding_window"] - 1, 0)])  # full and sliding layers
def test_gpt_oss_prefill_with_sinks(host_build, window):
    c = GPT_OSS
    q, k, v = _tensors(1, c["heads_q"], c["heads_kv"], 200, 200, c["head_dim"], seed=2)
    sinks = _sinks(c["heads_q"], 2)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, window_size=window, sinks=sinks, return_attn_probs=True)
    ref, ref_lse = attention_reference(*_native(q, k, v), is_causal=True, window_size=window, sinks=sinks,
                                       return_lse=True)
    assert _err(out.transpose(1, 2), ref) <= TOL and _err(lse, ref_lse) <= TOL
    without = attention_reference(*_native(q, k, v), is_causal=True, window_size=window)
    assert _err(out.transpose(1, 2), without) > 20 * TOL  # the sinks took weight


@pytest.mark.parametrize("num_splits", [0, 1, 4])  # automatic, one slice (the sink where rows are written), merged
@pytest.mark.parametrize("window", [(-1, -1), (GPT_OSS["sliding_window"] - 1, 0)])
def test_gpt_oss_decode_on_a_paged_cache_with_sinks(host_build, num_splits, window):
    c = GPT_OSS
    batch, page, pages = 2, 64, 6
    lengths = torch.tensor([pages * page, 150], dtype=torch.int32)
    q, k, v = _tensors(batch, c["heads_q"], c["heads_kv"], 1, pages * page, c["head_dim"], seed=3)
    order = torch.randperm(batch * pages, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    table = order.view(batch, pages)
    pool_k = torch.empty(batch * pages, page, c["heads_kv"], c["head_dim"], dtype=torch.float16)
    pool_v = torch.empty_like(pool_k)
    pool_k[order.long()] = k.reshape(-1, page, c["heads_kv"], c["head_dim"])
    pool_v[order.long()] = v.reshape(-1, page, c["heads_kv"], c["head_dim"])
    sinks = _sinks(c["heads_q"], 3)
    out, lse = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lengths, block_table=table, causal=True,
                                       window_size=window, num_splits=num_splits, return_softmax_lse=True,
                                       sinks=sinks)
    ref, ref_lse = attention_reference(*_native(q, k, v), is_causal=True, window_size=window, seqused_k=lengths,
                                       sinks=sinks, return_lse=True)
    assert _err(out.transpose(1, 2), ref) <= TOL and _err(lse, ref_lse) <= TOL


def test_gpt_oss_packed_batch_with_sinks(host_build):
    c = GPT_OSS
    lq, lk = (37, 1, 90), (37, 160, 90)
    q, k, v = _tensors(3, c["heads_q"], c["heads_kv"], max(lq), max(lk), c["head_dim"], seed=4)
    sinks = _sinks(c["heads_q"], 4)
    window = (c["sliding_window"] - 1, 0)
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lq, lk)]
    qp = torch.cat([q[b, :n] for b, n in enumerate(lq)])
    kp, vp = (torch.cat([t[b, :n] for b, n in enumerate(lk)]) for t in (k, v))
    out = flash_attn_varlen_func(qp, kp, vp, cu[0], cu[1], max(lq), max(lk), causal=True, window_size=window,
                                 sinks=sinks)
    for b, (nq, nk) in enumerate(zip(lq, lk)):
        ref = attention_reference(*_native(q[b:b + 1, :nq], k[b:b + 1, :nk], v[b:b + 1, :nk]), is_causal=True,
                                  window_size=window, sinks=sinks)
        assert _err(out[cu[0][b]:cu[0][b + 1]], ref[0].transpose(0, 1)) <= TOL


# --- ALiBi: Bloom, MPT, Baichuan -----------------------------------------------------------------

ALIBI_MODELS = {"bloom-560m": (16, 64), "mpt-7b": (32, 128), "baichuan-13b": (40, 128)}


def test_alibi_slopes_are_the_models():
    # Bloom's 16 heads: 2^-0.5 .. 2^-8; 40 heads: 32 of 2^(-i/4), then 8 odd steps of 2^(-i/8).
    assert torch.allclose(alibi_slopes(16), 2.0 ** (-0.5 * torch.arange(1, 17)))
    assert torch.allclose(alibi_slopes(40)[32:], 2.0 ** (-torch.arange(1, 17, 2) / 8.0))


@pytest.mark.parametrize("model", list(ALIBI_MODELS))
def test_alibi_models_prefill_and_decode(host_build, model):
    heads, head_dim = ALIBI_MODELS[model]
    slopes = alibi_slopes(heads)
    q, k, v = _tensors(2, heads, heads, 120, 120, head_dim, seed=5)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    ref, ref_lse = attention_reference(*_native(q, k, v), is_causal=True, alibi_slopes=slopes, return_lse=True)
    assert _err(out.transpose(1, 2), ref) <= TOL and _err(lse, ref_lse) <= TOL
    # The next token against the cache (per batch and head slopes: flash-attn's [batch, heads] form).
    per_batch = torch.stack([slopes, slopes.flip(0)])
    lengths = torch.tensor([120, 77], dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q[:, -1:].contiguous(), k, v, cache_seqlens=lengths, causal=True,
                                       alibi_slopes=per_batch, return_softmax_lse=True)
    ref, ref_lse = attention_reference(*_native(q[:, -1:], k, v), is_causal=True, seqused_k=lengths,
                                       alibi_slopes=per_batch, return_lse=True)
    assert _err(out.transpose(1, 2), ref) <= TOL and _err(lse, ref_lse) <= TOL
