"""Property-based tests of the INT8 entry points on the host platform: random shapes (zero-size
included), GQA ratios, causal masks, windows, softmax scales, decode shapes (the int8 split-KV
kernels) and strided views; flash_attn_int8qk against the float64 oracle on the dequantized
inputs (the error P's 7-bit quantization and the fp16 output leave), its log-sum-exp from the
unquantized P; flash_attn_int8qk_quantized (RoPE included) against flash_attn_int8qk on the
quantizers' output for the same (rotated) inputs; every input left as it was given."""

import torch
from cases import INT8_LSE_TOL, INT8_REL_RMS, host_head_dims, property_examples, query_and_key_lengths
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdnattention import (attention_reference, flash_attn_int8qk, flash_attn_int8qk_quantized, quantize_per_channel,
                          quantize_per_token, rotary_tables)
from rdnattention.reference import rotate

HEAD_DIMS = host_head_dims("host", "i8")
# RDNATTENTION_PROPERTY_EXAMPLES raises the budget for a longer hunt outside the suite.
EXAMPLES = property_examples()


@st.composite
def calls(draw):
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    heads_kv = draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.integers(1, 3))
    batch = draw(st.integers(0, 2))
    seq_q, seq_k = query_and_key_lengths(draw, 600)  # decode (split-KV) or prefill shapes
    options = {"is_causal": draw(st.booleans()),
               "window_size": (draw(st.integers(-1, 40)), draw(st.integers(-1, 40)))}
    if draw(st.booleans()):
        options["softmax_scale"] = draw(st.floats(0.01, 0.3))
    token_major = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return head_dim, heads_kv, heads_q, batch, seq_q, seq_k, options, token_major, seed


def _inputs(call):
    head_dim, heads_kv, heads_q, batch, seq_q, seq_k, _, token_major, seed = call
    g = torch.Generator().manual_seed(seed)
    shapes = ((heads_q, seq_q), (heads_kv, seq_k), (heads_kv, seq_k))
    if token_major:  # [batch, heads, seq, head_dim] views of token-major storage
        return [torch.randn(batch, s, h, head_dim, generator=g).half().transpose(1, 2) for h, s in shapes]
    return [torch.randn(batch, h, s, head_dim, generator=g).half() for h, s in shapes]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_int8qk_matches_the_oracle_on_dequantized_inputs(host_build, call):
    options = call[6]
    q, k, v = _inputs(call)
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
    given_ = [t.clone() for t in (qi, ki, vi, qs, ks, vs)]
    out, lse = flash_attn_int8qk(qi, ki, vi, qs, ks, vs, return_lse=True, **options)
    assert all(torch.equal(a, b) for a, b in zip((qi, ki, vi, qs, ks, vs), given_))
    assert out.shape == q.shape and out.dtype == torch.float16 and lse.shape == q.shape[:3]
    if not out.numel():
        return
    ref, ref_lse = attention_reference(qi.double() * qs.double()[..., None], ki.double() * ks.double()[..., None],
                                       vi.double() * vs.double()[:, :, None, :], return_lse=True, **options)
    assert torch.isfinite(out).all()
    norm = ref.norm().item()
    if norm == 0:  # no row sees a key
        assert not out.any()
    else:
        assert (out.double() - ref).norm().item() <= INT8_REL_RMS * norm
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= INT8_LSE_TOL


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls(), st.booleans())
def test_quantized_entry_is_int8qk_on_the_quantizers_output(host_build, call, rope):
    head_dim, options, seed = call[0], call[6], call[8]
    q, k, v = _inputs(call)
    seq_q, seq_k = q.shape[2], k.shape[2]
    extra = {}
    rope = rope and 0 < seq_k and seq_q <= seq_k  # every query at a table row
    if rope:
        cos, sin = rotary_tables(seq_k, head_dim // 2)
        extra = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=bool(seed % 2))
        # as the entry rotates (queries at the end of the keys), kept in fp32 for the quantizers
        rq = rotate(q.float(), cos, sin, torch.arange(seq_q) + seq_k - seq_q, extra["rotary_interleaved"])
        rk = rotate(k.float(), cos, sin, torch.arange(seq_k), extra["rotary_interleaved"])
    else:
        rq, rk = q, k
    given_ = [t.clone() for t in (q, k, v)]
    out, lse = flash_attn_int8qk_quantized(q, k, v, return_lse=True, **options, **extra)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), given_))
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(rq), quantize_per_token(rk), quantize_per_channel(v)
    ref, ref_lse = flash_attn_int8qk(qi, ki, vi, qs, ks, vs, return_lse=True, **options)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
