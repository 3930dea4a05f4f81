"""The quant kernel (rdnattention/families/quant.py) on the host emulator: quantize_per_token,
quantize_per_channel and flash_attn_int8qk_quantized launch it, and its int8 values and scales are
the torch formula's (int8._torch_quantize) byte for byte, for every input dtype, any strides,
head_dims up to 512 and the edge values of the formula; a vector with a NaN or an infinity is
refused where values are read and gets a NaN scale where not; what no kernel serves runs the
formula, counted and warned once."""

import warnings

import pytest
import torch

from rdnattention import (attention_reference, checks, flash_attn_int8qk, flash_attn_int8qk_quantized,
                          quantize_per_channel, quantize_per_token, replay)
from rdnattention import int8
from rdnattention.errors import InvalidArgumentError, UnsupportedError
from rdnattention.families import quant as quant_family

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]


def _launches() -> int:
    return int8.counts()["quantize_kernel"]


def _same(a: tuple, b: tuple) -> None:
    """Two quantizations: the same int8 values and the same scale bits."""
    assert a[0].dtype == b[0].dtype == torch.int8 and torch.equal(a[0], b[0])
    assert a[1].dtype == b[1].dtype == torch.float32 and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))


def _edges(x: torch.Tensor) -> torch.Tensor:
    """x with the formula's edge cases written into its first vectors along both axes: an all-zero
    vector (scale 1), an amax of exactly 127 with values on the halves (ties to even), and values
    so small that amax / 127 is below float32's smallest normal (the scale's floor)."""
    x = x.clone()
    d = x.shape[3]
    x[0, 0, 0] = 0
    ties = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 126.5, 1.5, -1.5])
    x[0, 0, 1, : min(d, 8)] = ties[: min(d, 8)].to(x.dtype)
    if x.shape[2] > 2:
        tiny = torch.finfo(x.dtype).tiny if x.dtype != torch.float16 else 2.0**-24  # fp16: its least subnormal
        x[0, 0, 2] = tiny
        x[0, 0, 2, ::3] = -2 * tiny
    x[..., 0] = 0  # the first channel all zero (per channel: scale 1)
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [8, 40, 64, 72, 128, 200, 512])
def test_the_kernel_is_the_torch_formula(host_build, dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    x = _edges((torch.randn(2, 3, 37, head_dim, generator=g) * 4).to(dtype))
    before = x.clone()
    start = _launches()
    _same(quantize_per_token(x), int8._torch_quantize("x", x, -1))
    _same(quantize_per_channel(x), int8._torch_quantize("v", x, 2))
    assert _launches() == start + 2
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_any_strides(host_build, dtype):
    """Token-major views, a feature stride of 2, and a broadcast (stride 0) head axis: read where they
    are, written contiguous."""
    g = torch.Generator().manual_seed(1)
    token_major = torch.randn(2, 19, 3, 64, generator=g).to(dtype).transpose(1, 2)
    every_other = torch.randn(1, 2, 11, 128, generator=g).to(dtype)[..., ::2]
    broadcast = torch.randn(1, 1, 9, 40, generator=g).to(dtype).expand(2, 4, 9, 40)
    for x in (token_major, every_other, broadcast):
        for quantize, dim in ((quantize_per_token, -1), (quantize_per_channel, 2)):
            got = quantize(x)
            _same(got, int8._torch_quantize("x", x, dim))
            assert got[0].is_contiguous() and got[1].is_contiguous()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_vector_that_is_not_finite(host_build, monkeypatch, bad):
    """Refused where values are read (CPU tensors by default); with RDNATTENTION_CHECK=0 its vector
    gets a NaN scale and zeros, and every other vector is the formula's."""
    x = torch.randn(1, 2, 5, 64, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    x[0, 1, 3, 7] = bad
    with pytest.raises(InvalidArgumentError, match="x holds a NaN or an infinity"):
        quantize_per_token(x)
    with pytest.raises(InvalidArgumentError, match="v holds a NaN or an infinity"):
        quantize_per_channel(x)
    with pytest.raises(InvalidArgumentError, match="k holds a NaN or an infinity"):
        flash_attn_int8qk_quantized(torch.randn(1, 2, 5, 64).half(), x, torch.randn(1, 2, 5, 64).half())
    monkeypatch.setattr(checks, "_mode", "never")
    clean = x.clone()
    clean[0, 1, 3, 7] = 0
    for quantize, dim, vector in ((quantize_per_token, -1, (0, 1, 3)), (quantize_per_channel, 2, (0, 1, 7))):
        values, scales = quantize(x)
        assert torch.isnan(scales[vector]) and scales.isnan().sum() == 1
        assert (values[0, 1, 3] == 0).all() if dim == -1 else (values[0, 1, :, 7] == 0).all()
        want_values, want_scales = int8._torch_quantize("x", clean, dim)
        keep = ~torch.isnan(scales)
        assert torch.equal(scales[keep], want_scales[keep])
        mask = keep.unsqueeze(dim).expand_as(values)
        assert torch.equal(values[mask], want_values[mask])


def test_empty_tensors_launch_nothing(host_build):
    start = _launches()
    values, scales = quantize_per_token(torch.randn(2, 3, 0, 64).half())
    assert values.shape == (2, 3, 0, 64) and values.dtype == torch.int8 and scales.shape == (2, 3, 0)
    values, scales = quantize_per_channel(torch.randn(1, 2, 0, 64).half())
    assert values.shape == (1, 2, 0, 64) and scales.shape == (1, 2, 64) and (scales == 1).all()
    assert _launches() == start


def test_what_no_kernel_serves_runs_the_formula_counted_and_warned_once(host_build, monkeypatch):
    int8.counts(reset=True)
    x = torch.randn(1, 2, 5, 520).half()  # over the kernels' head_dim
    with pytest.warns(RuntimeWarning, match="head_dim 520 is over the quant kernels' 512"):
        got = quantize_per_token(x)
    _same(got, int8._torch_quantize("x", x, -1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quantize_per_channel(x)  # the same reason: counted, not warned again
    assert int8.counts() == {"quantize_kernel": 0, "quantize_torch": 2,
                             "fallbacks": {"head_dim 520 is over the quant kernels' 512": 2}}

    def no_quant_kernel(table):
        raise UnsupportedError("no quant kernel")

    monkeypatch.setattr(quant_family, "select", no_quant_kernel)
    monkeypatch.setattr(replay, "cache", {})  # no kept launch of an earlier call
    q, k, v = (torch.randn(1, 2, 9, 64).half() for _ in range(3))
    with pytest.warns(RuntimeWarning, match="no quant kernel for host"):
        out = flash_attn_int8qk_quantized(q, k, v)
    counts = int8.counts(reset=True)
    assert counts["quantize_torch"] == 5 and counts["quantize_kernel"] == 0
    monkeypatch.undo()
    assert torch.equal(flash_attn_int8qk_quantized(q, k, v), out)  # the kernel's numbers are the formula's
    assert int8.counts()["quantize_kernel"] == 1


@pytest.mark.parametrize("shape", [(2, 4, 2, 33, 47, 64), (1, 8, 2, 1, 300, 128)], ids=["prefill", "decode"])
def test_the_quantized_entry_is_one_quant_launch_then_the_attention(host_build, shape):
    """flash_attn_int8qk_quantized: q, k and v quantized by one launch, the attention on them the
    same as flash_attn_int8qk's on the formula's quantization; a second call of the geometry
    replays both launches, to the same bytes."""
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    g = torch.Generator().manual_seed(seq_k)
    q = torch.randn(batch, heads_q, seq_q, head_dim, generator=g).half()
    k, v = (torch.randn(batch, heads_kv, seq_k, head_dim, generator=g).half() for _ in range(2))
    replay.clear()
    start = _launches()
    out, lse = flash_attn_int8qk_quantized(q, k, v, is_causal=seq_q > 1, return_lse=True)
    assert _launches() == start + 1
    (qi, qs), (ki, ks) = int8._torch_quantize("q", q, -1), int8._torch_quantize("k", k, -1)
    vi, vs = int8._torch_quantize("v", v, 2)
    want, want_lse = flash_attn_int8qk(qi, ki, vi, qs, ks, vs, is_causal=seq_q > 1, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref = attention_reference(qi.double() * qs.double()[..., None], ki.double() * ks.double()[..., None],
                              vi.double() * vs.double()[:, :, None, :], is_causal=seq_q > 1)
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 0.03
    hits = len(replay.cache)
    again, again_lse = flash_attn_int8qk_quantized(q, k, v, is_causal=seq_q > 1, return_lse=True)
    assert _launches() == start + 2  # the attention on the formula's tensors above launched none
    assert len(replay.cache) == hits and torch.equal(again, out) and torch.equal(again_lse, lse)


@pytest.mark.parametrize("shape", [(1, 4, 2, 30, 30, 64), (1, 8, 2, 1, 2000, 128)], ids=["prefill", "split_kv"])
def test_a_replay_keeps_the_quantized_inputs_in_the_workspace(host_build, monkeypatch, shape):
    """Where values are not read (GPU tensors, RDNATTENTION_CHECK=0), a replayed quantized call
    allocates its output alone: the int8 values and scales live in the stream's workspace, after a
    split-KV call's scratch. Calls of other values give what the full path gives."""
    from rdnattention.families import _splitkv

    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    monkeypatch.setattr(checks, "_mode", "never")
    monkeypatch.setattr(_splitkv, "units", lambda device: 64)  # a GPU's compute units: the keys split

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(batch, heads_q, seq_q, head_dim, generator=g).half(),
                *(torch.randn(batch, heads_kv, seq_k, head_dim, generator=g).half() for _ in range(2)))

    replay.clear()
    flash_attn_int8qk_quantized(*inputs(1), is_causal=seq_q > 1, return_lse=True)
    (kept,) = replay.cache.values()
    assert (kept.scratch_bytes > 0) == (seq_q == 1)
    with monkeypatch.context() as m:
        m.setattr(int8, "_quant_outputs", lambda *a: pytest.fail("a replay allocated the quantized inputs"))
        replayed = [flash_attn_int8qk_quantized(*inputs(seed), is_causal=seq_q > 1, return_lse=True)
                    for seed in (2, 3)]
    for seed, (out, lse) in zip((2, 3), replayed):
        replay.clear()
        want, want_lse = flash_attn_int8qk_quantized(*inputs(seed), is_causal=seq_q > 1, return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("quantize", [quantize_per_token, quantize_per_channel])
def test_a_quantizer_replays_the_launch_of_a_geometry_it_has_seen(host_build, monkeypatch, quantize):
    monkeypatch.setattr(replay, "cache", {})
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(2, 3, 17, 64, generator=g).half().transpose(1, 2) for _ in range(3)]
    first = quantize(xs[0])
    with monkeypatch.context() as m:
        m.setattr(int8, "_quant_launch", lambda *a: pytest.fail("planned again"))
        replayed = [quantize(x) for x in xs[1:]]
    assert len(replay.cache) == 1
    for x, got in zip(xs, [first, *replayed]):
        _same(got, int8._torch_quantize("x", x, 2 if quantize is quantize_per_channel else -1))
    bad = xs[2].clone()
    bad[0, 1, 2, 3] = float("nan")
    with pytest.raises(InvalidArgumentError, match="holds a NaN or an infinity"):
        quantize(bad)  # values still read on a replay
