"""The INT8 family on the host platform: every int8 kernel against the float64 oracle on the
dequantized inputs, the accuracy bounds docs/api.md states against the unquantized inputs, the
scale contract's typed errors, the quantizers, and the custom op."""

import dataclasses

import pytest
import torch
from cases import mirrored_kernels

from rdnattention import (attention_reference, flash_attn_int8qk, flash_attn_int8qk_quantized,
                          plan_flash_attn_int8qk, quantize_per_channel, quantize_per_token, rotary_tables)
from rdnattention.errors import InvalidArgumentError, UnsupportedError

# Against the oracle on the dequantized inputs, the only error is P's 7-bit quantization (and fp16
# output): relative RMS error of the output.
KERNEL_REL_RMS = 0.03
# Documented in docs/api.md (INT8 accuracy): against the oracle on the fp16 inputs themselves.
REL_RMS = 0.04
COSINE = 0.999


def _inputs(b=1, hq=4, hk=2, sq=97, sk=97, d=64, seed=0, outliers=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h, s in ((hq, sq), (hk, sk), (hk, sk)))
    if outliers:
        channels = torch.randperm(d, generator=g)[:4]
        q[..., channels] *= 10
        k[..., channels] *= 10
    return q.half(), k.half(), v.half()


def _dequantized(qi, qs, ki, ks, vi, vs):
    return (qi.double() * qs.double()[..., None], ki.double() * ks.double()[..., None],
            vi.double() * vs.double()[:, :, None, :])


def _rel_rms(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


CASES = {
    "plain": ({}, {}),
    "causal": ({}, {"is_causal": True}),
    "window": ({}, {"is_causal": True, "window_size": (37, -1)}),
    "two_sided": ({}, {"window_size": (21, 9)}),
    "mqa": ({"hq": 3, "hk": 1}, {}),
    "cross": ({"sq": 45, "sk": 170}, {"is_causal": True}),
    "decode": ({"b": 2, "sq": 1, "sk": 203}, {}),
    "scale": ({}, {"softmax_scale": 0.05}),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_the_oracle_on_dequantized_inputs(host_build, case, head_dim):
    shape, options = CASES[case]
    q, k, v = _inputs(d=head_dim, **shape)
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
    out, lse = flash_attn_int8qk(qi, ki, vi, qs, ks, vs, return_lse=True, **options)
    ref, ref_lse = attention_reference(*_dequantized(qi, qs, ki, ks, vi, vs), return_lse=True, **options)
    assert out.dtype == torch.float16 and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert _rel_rms(out, ref) <= KERNEL_REL_RMS
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3  # from the unquantized P: fp32-exact


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_documented_accuracy_against_unquantized_inputs(host_build, head_dim, outliers):
    q, k, v = _inputs(d=head_dim, sq=128, sk=128, outliers=outliers, seed=1)
    scale = (0.2 if outliers else 1.0) / head_dim ** 0.5
    for causal in (False, True):
        out = flash_attn_int8qk_quantized(q, k, v, is_causal=causal, softmax_scale=scale)
        ref = attention_reference(q, k, v, is_causal=causal, softmax_scale=scale)
        assert _rel_rms(out, ref) <= REL_RMS
        cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.flatten(), dim=0).item()
        assert cos >= COSINE


def test_strided_views_and_rope(host_build):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 40, 4, 64, generator=g).half().transpose(1, 2)  # token-major storage
    k = torch.randn(2, 60, 2, 64, generator=g).half().transpose(1, 2)
    v = torch.randn(2, 60, 2, 64, generator=g).half().transpose(1, 2)
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
    qi, ki, vi = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (qi, ki, vi))
    assert not qi.is_contiguous()
    out = flash_attn_int8qk(qi, ki, vi, qs, ks, vs, is_causal=True)
    ref = attention_reference(*_dequantized(qi, qs, ki, ks, vi, vs), is_causal=True)
    assert _rel_rms(out, ref) <= KERNEL_REL_RMS
    cos, sin = rotary_tables(60, 32)
    out = flash_attn_int8qk_quantized(q, k, v, is_causal=True, rotary_cos=cos, rotary_sin=sin)
    ref = attention_reference(q, k, v, is_causal=True, rotary_cos=cos, rotary_sin=sin)
    assert _rel_rms(out, ref) <= REL_RMS


def test_quantizers():
    q, _, v = _inputs(d=64)
    q[0, 0, 3] = 0
    qi, qs = quantize_per_token(q)
    assert qi.dtype == torch.int8 and qs.shape == q.shape[:3] and qs[0, 0, 3] == 1 and (qi[0, 0, 3] == 0).all()
    assert ((qi.float() * qs[..., None] - q.float()).abs() <= qs[..., None] / 2 + 1e-6).all()
    assert qi.abs().max() == 127
    vi, vs = quantize_per_channel(v)
    assert vs.shape == (1, 2, 64) and ((vi.float() * vs[:, :, None] - v.float()).abs() <= vs[:, :, None] / 2 + 1e-6).all()
    with pytest.raises(InvalidArgumentError, match="x holds a NaN or an infinity"):
        quantize_per_token(torch.full((1, 1, 2, 64), float("nan")))
    with pytest.raises(InvalidArgumentError, match="x must be float16, bfloat16 or float32, got torch.int8"):
        quantize_per_token(qi)


def _quantized(**shape):
    q, k, v = _inputs(**shape)
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
    return [qi, ki, vi, qs, ks, vs]


@pytest.mark.parametrize("index, bad, message", [
    (0, lambda t: t.float(), "q must be int8, got torch.float32"),
    (1, lambda t: t[..., :48], "k shape (1, 2, 97, 48) does not match q shape (1, 4, 97, 64)"),
    (3, lambda t: t.double(), "q_scale must be float32, got torch.float64"),
    (4, lambda t: t[:, :1], r"k_scale must have shape (1, 2, 97) (per token of k), got (1, 1, 97)"),
    (5, lambda t: t[..., :32], r"v_scale must have shape (1, 2, 64) (per channel of v), got (1, 2, 32)"),
    (4, lambda t: t.index_fill(2, torch.tensor([5]), 0.0), "k_scale must hold positive finite scales"),
    (5, lambda t: t.index_fill(2, torch.tensor([5]), float("nan")), "v_scale must hold positive finite scales"),
    (3, lambda t: -t, "q_scale must hold positive finite scales"),
    (0, lambda t: t.new_zeros(1, 4, 97, 72)[..., 4:68], "q rows must start on 16-byte boundaries"),
])
def test_the_scale_contract_is_checked(host_build, index, bad, message):
    args = _quantized()
    args[index] = bad(args[index])
    with pytest.raises(InvalidArgumentError) as err:
        flash_attn_int8qk(*args)
    assert message in str(err.value)


def test_a_target_without_int8_kernels_is_refused(host_build, monkeypatch):
    from rdnattention import route
    real = route.device_table(torch.device("cpu"))
    fp16_only = dataclasses.replace(real, kernels=tuple(e for e in real.kernels if e.family != "i8"))
    monkeypatch.setattr(route, "device_table", lambda device: fp16_only)
    with pytest.raises(UnsupportedError, match="target host has no int8 kernels .* use flash_attn, the fp16 kernel"):
        flash_attn_int8qk(*_quantized())


def test_plan_and_forced_kernel(host_build):
    args = _quantized(sq=40, sk=40)
    plan = plan_flash_attn_int8qk(*args, is_causal=True)
    [launch] = plan.launches
    assert launch.kernel.family == "i8" and launch.kernel.gqa_group == 2 and launch.args.heavy_first == 1
    plan.run()
    assert torch.equal(plan.outputs[0], flash_attn_int8qk(*args, is_causal=True))


@pytest.mark.parametrize("return_lse", [False, True])
def test_opcheck(host_build, return_lse):
    args = _quantized(sq=40, sk=50)
    op = torch.ops.rdnattention.flash_attn_int8qk_fwd.default
    torch.library.opcheck(op, (*args, -1, 0, 0.125, return_lse),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape, options", [
    ({"b": 2, "hq": 4, "hk": 4, "sq": 1, "sk": 300}, {}),
    ({"b": 1, "hq": 8, "hk": 2, "sq": 1, "sk": 257}, {"is_causal": True}),
    ({"b": 1, "hq": 4, "hk": 2, "sq": 3, "sk": 200}, {"is_causal": True, "window_size": (40, 0)}),
])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_runs_the_int8_split_kv_kernels(host_build, shape, options, head_dim, splits):
    """Few query rows per K/V head: the i8dec kernels (P is not quantized there: only Q, K, V are)."""
    from rdnattention import route
    from rdnattention.families import i8, i8dec

    q, k, v = _inputs(d=head_dim, **shape)
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
    assert plan_flash_attn_int8qk(qi, ki, vi, qs, ks, vs, **options).launches[0].kernel.family == "i8dec"
    left, right = options.get("window_size", (-1, -1))
    if options.get("is_causal"):
        right = 0
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    call = i8.Call(q=qi, k=ki, v=vi, q_scale=qs, k_scale=ks, v_scale=vs, out=out, lse=lse, window=(left, right),
                   softmax_scale=head_dim ** -0.5)
    plan = i8dec.plan(route.device_table(q.device), call, num_splits=splits)
    assert len(plan.launches) == 1 and (plan.counters > 0) == (splits > 1)
    plan.run()
    ref, ref_lse = attention_reference(*_dequantized(qi, qs, ki, ks, vi, vs), return_lse=True, **options)
    assert (out.double() - ref).abs().max().item() <= 2e-3  # fp32 products of the int8 values: fp16 rounding only
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-3


# The AMD tables' int8 tiles (host) and sm_90's tuned ones (host_f32), built as alternates: every
# case through each of them.
@pytest.mark.parametrize("target,name", mirrored_kernels(("i8",)))
def test_mirrored_gpu_tiles_match_the_oracle(host_build, monkeypatch, target, name):
    from rdnattention_gen.families import spec_from_name

    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    spec = spec_from_name(name)
    for case in ("plain", "causal", "two_sided", "cross"):
        shape, options = CASES[case]
        q, k, v = _inputs(d=spec.head_dim, **shape)
        (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
        plan = plan_flash_attn_int8qk(qi, ki, vi, qs, ks, vs, kernel=name, **options)
        assert plan.launches[-1].kernel.name == name
        plan.run()
        ref = attention_reference(*_dequantized(qi, qs, ki, ks, vi, vs), **options)
        assert _rel_rms(plan.outputs[0], ref) <= KERNEL_REL_RMS, case


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_quantizers_leave_their_input_as_it_was(dtype):
    x = torch.randn(1, 2, 8, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    before = x.clone()
    quantize_per_token(x)
    quantize_per_channel(x)
    assert torch.equal(x, before)
