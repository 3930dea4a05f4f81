"""Property-based tests of the forward pass on the host platform: random shapes (zero-size
included), layouts (head-major, token-major and padded views), GQA ratios, windows, causal masks,
RoPE, fp16 and bf16, every multiple of 8 up to 128 as head_dim (those without kernels of their own
run a larger one's), softcaps, ALiBi per head and per batch, sinks, per-sequence key counts, and
decode shapes (a few queries on hundreds of keys: the split-KV kernels); every call against the
float64 oracle, the log-sum-exp included, and the inputs left as they were given."""

import torch
from cases import TOLS, TORCH_DTYPES, output_bound, property_examples, query_and_key_lengths
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from rdnattention import attention_reference, flash_attn, flash_attn_func, rotary_tables
from rdnattention.errors import UnsupportedError

# RDNATTENTION_PROPERTY_EXAMPLES raises the budget for a longer hunt outside the suite.
EXAMPLES = property_examples(60)


@st.composite
def calls(draw):
    dtype = draw(st.sampled_from(sorted(TORCH_DTYPES)))
    head_dim = 8 * draw(st.integers(1, 16))  # the emulator runs every thread: up to 128 keeps cases quick
    heads_kv = draw(st.integers(1, 3))
    heads_q = heads_kv * draw(st.integers(1, 3))
    batch = draw(st.integers(0, 2))
    seq_q, seq_k = query_and_key_lengths(draw)  # decode (split-KV) or prefill shapes
    layout = draw(st.sampled_from(["head_major", "token_major", "padded"]))
    options = {"is_causal": draw(st.booleans()),
               "window_size": (draw(st.integers(-1, 40)), draw(st.integers(-1, 40)))}
    if draw(st.booleans()):
        options["softcap"] = draw(st.floats(1.0, 30.0))
    alibi = draw(st.sampled_from([None, "heads", "batch"]))
    if alibi is not None:  # flash-attn's two forms: [heads_q], or [batch, heads_q]
        shape = (heads_q,) if alibi == "heads" else (batch, heads_q)
        slopes = [draw(st.floats(0.0, 1.0)) for _ in range(heads_q * (batch if alibi == "batch" else 1))]
        options["alibi_slopes"] = torch.tensor(slopes, dtype=torch.float32).view(shape)
    if draw(st.booleans()):
        options["sinks"] = torch.tensor([draw(st.floats(-4.0, 4.0)) for _ in range(heads_q)])
    used = tuple(draw(st.integers(0, seq_k)) for _ in range(batch)) if draw(st.booleans()) else None
    rope = draw(st.booleans()) and seq_q <= min(used or (seq_k,)) and seq_k > 0  # every query at a table row
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, layout, options, used, rope, seed


def _tensor(g, batch, heads, seq, dim, layout, dtype=torch.float16):
    data = torch.randn(batch, heads, seq, dim, generator=g).to(dtype)
    if layout == "token_major":
        return data.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "padded":  # rows inside a wider buffer: head_dim + 8 elements per row
        wide = torch.zeros(batch, heads, seq, dim + 8, dtype=dtype)
        wide[..., :dim] = data
        return wide[..., :dim]
    return data


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(calls())
def test_matches_the_oracle(host_build, call):
    dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, layout, options, used, rope, seed = call
    g = torch.Generator().manual_seed(seed)
    q = _tensor(g, batch, heads_q, seq_q, head_dim, layout, TORCH_DTYPES[dtype])
    k = _tensor(g, batch, heads_kv, seq_k, head_dim, layout, TORCH_DTYPES[dtype])
    v = _tensor(g, batch, heads_kv, seq_k, head_dim, layout, TORCH_DTYPES[dtype])
    if rope:
        cos, sin = rotary_tables(seq_k, head_dim if head_dim <= 64 else head_dim // 2)
        options.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=bool(seed % 2))
    if used is not None:
        options["seqused_k"] = torch.tensor(used, dtype=torch.int32)
    given_ = [t.clone() for t in (q, k, v, *(t for t in options.values() if isinstance(t, torch.Tensor)))]
    try:  # the host build leaves out some score options' kernels at some head_dims and dtypes
        out, lse = flash_attn(q, k, v, return_lse=True, **options)
    except UnsupportedError:
        assume(False)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, *(t for t in options.values()
                                                              if isinstance(t, torch.Tensor))), given_))
    for name in ("softcap", "alibi_slopes", "sinks", "seqused_k", "rotary_cos"):
        if name in options:
            event(f"served with {name}")
    event(f"served: {'decode' if 0 < seq_q <= 4 and seq_k >= 100 else 'prefill'}, {dtype}")
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    if not out.numel():
        return
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    lse_tol = TOLS[dtype][1]
    err = (out.double() - ref).abs()
    assert (err <= output_bound(ref, dtype)).all(), f"max abs error {err.max().item():.2e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= lse_tol


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_token_major_entry_agrees_with_the_native_one(host_build, call):
    """flash_attn_func (flash-attn's layout and argument names) gives flash_attn's result bit for bit."""
    dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, _, options, _, _, seed = call
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, s, h, head_dim, generator=g).to(TORCH_DTYPES[dtype])
               for s, h in ((seq_q, heads_q), (seq_k, heads_kv), (seq_k, heads_kv)))
    shared = {name: options[name] for name in ("window_size", "softcap", "alibi_slopes") if name in options}
    try:
        native = flash_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=options["is_causal"],
                            **shared)
    except UnsupportedError:
        assume(False)
    out = flash_attn_func(q, k, v, causal=options["is_causal"], **shared)
    assert out.shape == q.shape and torch.equal(out, native.transpose(1, 2))


def test_oracle_handles_no_keys():
    q = torch.randn(1, 2, 3, 64).half()
    k = torch.randn(1, 2, 0, 64).half()
    out, lse = attention_reference(q, k, k, return_lse=True)
    assert out.shape == (1, 2, 3, 64) and (out == 0).all() and torch.isinf(lse).all()
