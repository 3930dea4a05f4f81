"""Property-based tests on the host platform: random shapes (zero-size included), layouts
(head-major, token-major and padded views), GQA ratios, windows, causal masks and RoPE, every
call against the float64 oracle."""

import torch
from cases import host_head_dims
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdnattention import attention_reference, flash_attn, flash_attn_func, rotary_tables

TOL = 2e-3
# The host target's head_dims (variants.yaml) up to 128: the emulator runs every thread, keep cases quick.
SMALL_HEAD_DIMS = [d for d in host_head_dims("host", "f16") if d <= 128]


@st.composite
def calls(draw):
    head_dim = draw(st.sampled_from(SMALL_HEAD_DIMS))
    heads_kv = draw(st.integers(1, 3))
    heads_q = heads_kv * draw(st.integers(1, 3))
    batch = draw(st.integers(0, 2))
    seq_q = draw(st.integers(0, 70))
    seq_k = draw(st.integers(0, 90))
    layout = draw(st.sampled_from(["head_major", "token_major", "padded"]))
    causal = draw(st.booleans())
    window = (draw(st.integers(-1, 40)), draw(st.integers(-1, 40)))
    rope = draw(st.booleans()) and 0 < seq_k and seq_q <= seq_k  # RoPE positions must be table rows
    seed = draw(st.integers(0, 2**31 - 1))
    return head_dim, heads_kv, heads_q, batch, seq_q, seq_k, layout, causal, window, rope, seed


def _tensor(g, batch, heads, seq, dim, layout):
    data = torch.randn(batch, heads, seq, dim, generator=g).half()
    if layout == "token_major":
        return data.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "padded":  # rows inside a wider buffer: head_dim + 8 elements per row
        wide = torch.zeros(batch, heads, seq, dim + 8, dtype=torch.float16)
        wide[..., :dim] = data
        return wide[..., :dim]
    return data


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_matches_the_oracle(host_build, call):
    head_dim, heads_kv, heads_q, batch, seq_q, seq_k, layout, causal, window, rope, seed = call
    g = torch.Generator().manual_seed(seed)
    q = _tensor(g, batch, heads_q, seq_q, head_dim, layout)
    k = _tensor(g, batch, heads_kv, seq_k, head_dim, layout)
    v = _tensor(g, batch, heads_kv, seq_k, head_dim, layout)
    options = {"is_causal": causal, "window_size": window}
    if rope:
        cos, sin = rotary_tables(seq_k, head_dim if head_dim <= 64 else head_dim // 2)
        options.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=bool(seed % 2))
    copies = [t.clone() for t in (q, k, v)]
    out, lse = flash_attn(q, k, v, return_lse=True, **options)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), copies))
    if out.numel():
        assert (out.double() - ref).abs().max().item() <= TOL
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        finite = torch.isfinite(ref_lse)
        if finite.any():
            assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= TOL


@settings(max_examples=15, deadline=None)
@given(calls())
def test_token_major_entry_agrees_with_the_native_one(host_build, call):
    head_dim, heads_kv, heads_q, batch, seq_q, seq_k, _, causal, window, _, seed = call
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, s, h, head_dim, generator=g).half()
               for s, h in ((seq_q, heads_q), (seq_k, heads_kv), (seq_k, heads_kv)))
    out = flash_attn_func(q, k, v, causal=causal, window_size=window)
    native = flash_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, window_size=window)
    assert out.shape == q.shape and torch.equal(out, native.transpose(1, 2))


def test_oracle_handles_no_keys():
    q = torch.randn(1, 2, 3, 64).half()
    k = torch.randn(1, 2, 0, 64).half()
    out, lse = attention_reference(q, k, k, return_lse=True)
    assert out.shape == (1, 2, 3, 64) and (out == 0).all() and torch.isinf(lse).all()
