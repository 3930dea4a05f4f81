"""The real gfx1100 code objects, executed: every family called through the public API, planned by
the runtime, launched by the HIP driver, run instruction by instruction on an RDNA3 ISA emulator
(tests/amd_emulator.py) and compared with the float64 oracle.

gfx1100 shares the dot2 templates, wave32, the argument structs and the driver path with gfx1030;
gfx10 and GCN encodings and the ROCm runtime itself are not executed here. Skipped where the
emulator snapshot is absent (a checkout without ../shared; RDNATTENTION_TINYGRAD names another)."""

import gc
import warnings

import pytest
import torch

import amd_emulator
from cases import GRAD_TOL, MATRIX, counted_express, fresh_replays
from rdnattention import (attention_gradients, attention_reference, flash_attn, flash_attn_int8qk, flash_attn_varlen_func,
                          flash_attn_with_kvcache, plan_flash_attn, plan_flash_attn_int8qk, quantize_per_channel,
                          quantize_per_token, rotary_tables)
from rdnattention import ops, replay, route
from rdnattention.families import bwd, dec, f16
from rdnattention_gen.families import spec_from_name

TARGET = "gfx1100"
TOL = 2e-3          # as on the host platform: fp16 rounding of the output and of the probabilities
BF16_TOL = 8 * TOL  # bf16's unit roundoff, 8x fp16's (tests/cases.py)
INT8_REL_RMS = 0.03  # tests/kernels/test_int8.py: P's 7-bit quantization against the dequantized oracle

SNAPSHOT = amd_emulator.snapshot()
pytestmark = [
    pytest.mark.amd_emulator,
    pytest.mark.skipif(SNAPSHOT is None, reason=f"the RDNA3 emulator snapshot is absent: set "
                                                f"{amd_emulator.SNAPSHOT_ENV} to a tinygrad source tree holding "
                                                f"{amd_emulator.EMULATOR} (CI uses ../shared/third_party/tinygrad)"),
]


@pytest.fixture(scope="module")
def gpu(matrix, build_dir, monkeypatch_module):
    """CPU tensors served as if on a gfx1100 GPU: the HIP driver with the stand-in runtime under it."""
    return amd_emulator.serve_as_gpu(monkeypatch_module, matrix, build_dir, SNAPSHOT, TARGET)[1]


@pytest.fixture()
def dispatched(gpu):
    """The kernels the test launched, checked for stand-in failures and a live image afterwards."""
    start = len(gpu.dispatches)
    names = []
    yield names
    assert not gpu.failures, gpu.failures
    gc.collect()
    for module in gpu.modules.values():
        assert gpu.image_intact(module), "the image given to hipModuleLoadData was freed or overwritten"
    names.extend(d.kernel for d in gpu.dispatches[start:])


def _families(gpu, start):
    return sorted({d.kernel.split("_hd")[0] for d in gpu.dispatches[start:]})


def _inputs(b, hq, hk, sq, sk, d, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, sq, d, generator=g).to(dtype), torch.randn(b, hk, sk, d, generator=g).to(dtype),
            torch.randn(b, hk, sk, d, generator=g).to(dtype))


def _max_err(out, ref):
    return (out.double() - ref).abs().max().item()


def _rel_rms(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _dequantized(qi, qs, ki, ks, vi, vs):
    return (qi.double() * qs.double()[..., None], ki.double() * ks.double()[..., None],
            vi.double() * vs.double()[:, :, None, :])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_causal_gqa(gpu, dispatched, head_dim):
    start = len(gpu.dispatches)
    q, k, v = _inputs(1, 4, 2, 80, 80, head_dim)
    out, lse = flash_attn(q, k, v, is_causal=True, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, is_causal=True, return_lse=True)
    assert _families(gpu, start) == ["fa2_f16"]
    assert gpu.dispatches[start].kernel.split("_")[3] == "g2"  # the GQA-2 kernel
    assert _max_err(out, ref) <= TOL
    assert _max_err(lse, ref_lse) <= TOL


def test_prefill_window_and_rope(gpu, dispatched):
    start = len(gpu.dispatches)
    q, k, v = _inputs(1, 2, 2, 48, 96, 128, seed=1)
    cos, sin = rotary_tables(96, 64)
    options = dict(window_size=(32, 8), rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
    out = flash_attn(q, k, v, **options)
    assert _families(gpu, start) == ["fa2_f16"]
    assert _max_err(out, attention_reference(q, k, v, **options)) <= TOL


def test_int8(gpu, dispatched):
    q, k, v = _inputs(1, 2, 1, 64, 64, 64, seed=2)
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
    start = len(gpu.dispatches)
    out = flash_attn_int8qk(qi, ki, vi, qs, ks, vs, is_causal=True)
    ref = attention_reference(*_dequantized(qi, qs, ki, ks, vi, vs), is_causal=True)
    assert _families(gpu, start) == ["fa2_i8"]
    assert _rel_rms(out, ref) <= INT8_REL_RMS


def test_split_kv_decode(gpu, dispatched):
    """Key slices merged by the last slice of each row chunk to finish (its atomic count and the
    fences around it, executed), in one launch."""
    start = len(gpu.dispatches)
    q, k, v = _inputs(1, 4, 2, 1, 700, 128, seed=3)
    out, lse = flash_attn(q, k, v, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    assert _families(gpu, start) == ["fa2_dec"] and len(gpu.dispatches) == start + 1
    assert gpu.dispatches[start].grid[0] > 1  # the keys were split into slices
    assert _max_err(out, ref) <= TOL
    assert _max_err(lse, ref_lse) <= TOL


def test_decode_with_padded_lanes(gpu, dispatched):
    """head_dim 40: the decode kernel with three of the eight lanes of each key padding, and its
    merge of the slices over 5 lanes a row. (The by-name sweep, marked slow, runs every kernel of
    every head_dim.)"""
    start = len(gpu.dispatches)
    q, k, v = _inputs(1, 4, 2, 1, 700, 40, seed=7)
    out, lse = flash_attn(q, k, v, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True)
    assert _families(gpu, start) == ["fa2_dec"] and len(gpu.dispatches) == start + 1
    assert gpu.dispatches[start].grid[0] > 1  # the keys were split into slices
    assert _max_err(out, ref) <= TOL
    assert _max_err(lse, ref_lse) <= TOL


def test_paged_decode_with_append(gpu, dispatched):
    start = len(gpu.dispatches)
    g = torch.Generator().manual_seed(4)
    batch, page, pages, hk, d = 2, 16, 12, 2, 64
    pool_k, pool_v = (torch.randn(pages, page, hk, d, generator=g).half() for _ in range(2))
    table = torch.randperm(pages, generator=g)[:batch * 5].reshape(batch, 5).to(torch.int32)
    lengths = torch.tensor([37, 70], dtype=torch.int32)
    q = torch.randn(batch, 1, 4, d, generator=g).half()
    k_new, v_new = (torch.randn(batch, 1, hk, d, generator=g).half() for _ in range(2))
    pool_k_before, pool_v_before = pool_k.clone(), pool_v.clone()
    out = flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new, cache_seqlens=lengths, block_table=table)
    assert "fa2_decpaged" in _families(gpu, start)
    for b, n in enumerate(lengths.tolist()):
        rows = lambda pool: pool[table[b].long()].reshape(-1, hk, d)  # noqa: E731
        keys, values = rows(pool_k_before).clone(), rows(pool_v_before).clone()
        keys[n], values[n] = k_new[b, 0], v_new[b, 0]
        assert torch.equal(rows(pool_k)[:n + 1], keys[:n + 1])  # appended in place, nothing else touched
        ref = attention_reference(q[b:b + 1].transpose(1, 2), keys[None, :n + 1].transpose(1, 2),
                                  values[None, :n + 1].transpose(1, 2))
        assert _max_err(out[b:b + 1].transpose(1, 2), ref) <= TOL


def test_varlen(gpu, dispatched):
    start = len(gpu.dispatches)
    g = torch.Generator().manual_seed(5)
    lengths_q, lengths_k = [17, 40, 1], [17, 55, 30]
    q = torch.randn(sum(lengths_q), 4, 64, generator=g).half()
    k, v = (torch.randn(sum(lengths_k), 2, 64, generator=g).half() for _ in range(2))
    cu = lambda n: torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = cu(lengths_q), cu(lengths_k)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True)
    assert "fa2_f16varlen" in _families(gpu, start)
    view = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    for b in range(len(lengths_q)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref = attention_reference(view(q[qs]), view(k[ks]), view(v[ks]), is_causal=True)
        assert _max_err(view(out[qs]), ref) <= TOL


def _grad_err(grads, refs):
    """Each gradient's largest error, relative to the oracle's largest element of it."""
    return [((g.double() - r).abs().max() / r.abs().max()).item() for g, r in zip(grads, refs)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_backward_through_autograd(gpu, dispatched, dtype):
    """A causal GQA call that requires grad: the forward, then the backward's three passes, each a
    gfx1100 kernel, against the float64 oracle's gradients (tests/kernels/test_backward.py's bound)."""
    start = len(gpu.dispatches)
    q, k, v = _inputs(1, 4, 2, 45, 45, 64, seed=8, dtype=dtype)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attn(*leaves, is_causal=True).backward(dout)
    suffix = "_bf16" if dtype == torch.bfloat16 else ""
    assert _families(gpu, start) == [f + suffix for f in ("fa2_bwd", "fa2_bwddq", "fa2_bwdpre", "fa2_f16")]
    refs = attention_gradients(q, k, v, dout, is_causal=True)
    assert max(_grad_err([t.grad for t in leaves], refs)) <= GRAD_TOL[dtype]


def test_backward_with_seqused_k(gpu, dispatched):
    """Per-sequence key counts with grad (a cache of 60 keys, sequences using 37 and 0): the
    backward's gfx1100 passes give each sequence the oracle's gradients on its own keys, and zero to
    the keys past them."""
    q, k, v = _inputs(2, 4, 2, 20, 60, 64, seed=12)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(13)).half()
    used = (37, 0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    start = len(gpu.dispatches)
    flash_attn(*leaves, is_causal=True, seqused_k=torch.tensor(used, dtype=torch.int32)).backward(dout)
    assert [f for f in _families(gpu, start) if f.startswith("fa2_bwd")] == ["fa2_bwd", "fa2_bwddq", "fa2_bwdpre"]
    dq, dk, dv = (t.grad for t in leaves)
    refs = attention_gradients(q[:1], k[:1, :, :37], v[:1, :, :37], dout[:1], is_causal=True)
    assert max(_grad_err([dq[:1], dk[:1, :, :37], dv[:1, :, :37]], refs)) <= GRAD_TOL[torch.float16]
    assert not dk[0, :, 37:].any() and not dv[0, :, 37:].any() and not dq[1].any() and not dk[1].any() and not dv[1].any()


def test_the_packed_backward(gpu, dispatched):
    """Packed sequences that require grad (flash_attn_varlen_func): the forward, then the
    deterministic passes over the sequences (AMD's default), and the atomic passes of the same call
    forced; each sequence against the oracle's gradients, a sequence without rows, one without
    keys, and rows past the last sequence (zero)."""
    lengths_q, lengths_k = [20, 0, 37, 6], [25, 4, 37, 0]
    g = torch.Generator().manual_seed(21)
    q, dout = (torch.randn(sum(lengths_q) + 2, 4, 64, generator=g).half() for _ in range(2))
    k, v = (torch.randn(sum(lengths_k), 2, 64, generator=g).half() for _ in range(2))
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    view = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    refs = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for b in range(len(lengths_q)):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lengths_q[b] and lengths_k[b]:
            parts = attention_gradients(view(q[qs]), view(k[ks]), view(v[ks]), view(dout[qs]), is_causal=True)
            for r, part, rows in zip(refs, parts, (qs, ks, ks)):
                r[rows] = part[0].transpose(0, 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    start = len(gpu.dispatches)
    out, lse, _ = flash_attn_varlen_func(*leaves, cu_q, cu_k, 37, 37, causal=True, return_attn_probs=True)
    out.backward(dout)
    assert _families(gpu, start)[:3] == ["fa2_bwd", "fa2_bwddq", "fa2_bwdpre"]
    assert max(_grad_err([t.grad for t in leaves], refs)) <= GRAD_TOL[torch.float16]
    assert not leaves[0].grad[sum(lengths_q):].any()
    start = len(gpu.dispatches)
    grads = ops.backward(dout, q, k, v, out.detach(), lse.detach(), None, -1, 0, 64 ** -0.5, 0.0, atomic=True,
                         packed=(cu_q, cu_k, 37, 37))
    assert [d.kernel.split("_")[1] for d in gpu.dispatches[start:]] == ["bwdpre", "bwdatomic", "bwddqcast"]
    assert max(_grad_err(grads, refs)) <= GRAD_TOL[torch.float16]


def test_the_atomic_backward_passes(gpu, dispatched):
    """gfx1100's atomic passes (dQ added into an fp32 sum by global atomics: AMD takes them only when
    forced), beside the deterministic passes of the same tile, at head_dim 64 in fp16."""
    _backward_set(gpu, next(n for n in _kernels() if n.startswith("fa2_bwd_hd64_")))


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "own_launch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("rope", [None, True, False], ids=["copy", "rope", "ropehalf"])
def test_the_append_kernel_is_the_torch_append(gpu, dispatched, monkeypatch, rope, dtype, fuse):
    """flash_attn_with_kvcache's append of each RoPE mode and dtype, fused into the paged split-KV
    decode's launch (its only launch; with RoPE tables it rotates the queries it reads too) or as the
    append kernel's own launch before it (tests/kernels/test_append.py runs both on the host), against
    the torch operations it replaces, byte for byte: a paged cache, causal query rotation, float64
    RoPE rounded as torch rounds it (float32, then the dtype)."""
    from rdnattention import kvcache

    if not fuse:
        monkeypatch.setattr(kvcache, "FUSE_MAX_NEW", 0)

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 4, 64, generator=g).to(dtype)
    pools = [torch.randn(6, 16, 2, 64, generator=g).to(dtype) for _ in range(2)]
    k, v = (torch.randn(2, 2, 2, 64, generator=g).to(dtype) for _ in range(2))
    kwargs = dict(cache_seqlens=torch.tensor([30, 3], dtype=torch.int32), causal=True,
                  block_table=torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32))
    if rope is not None:
        cos, sin = rotary_tables(40, 48)
        kwargs.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rope)
    results = []
    for kernel in (True, False):
        start = len(gpu.dispatches)
        with monkeypatch.context() as m:
            if not kernel:
                m.setattr(kvcache, "_append_kernel", lambda *a: False)
            pk, pv = (t.clone() for t in pools)
            replay.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the forced fallback's warning
                out = flash_attn_with_kvcache(q, pk, pv, k, v, **kwargs)
        results.append(([d.kernel for d in gpu.dispatches[start:]], out, pk, pv))
    (launched, out, pk, pv), (t_launched, t_out, t_pk, t_pv) = results
    if fuse:
        (first,) = launched
        assert first.startswith("fa2_decpaged_" + ("bf16_" if dtype == torch.bfloat16 else "")), launched
    else:
        name = ("fa2_append" + {None: "", True: "_rope", False: "_ropehalf"}[rope]
                + ("_bf16" if dtype == torch.bfloat16 else "") + "_upto512_")
        assert launched[0].startswith(name) and len(launched) == 2, launched
    assert not t_launched[0].startswith("fa2_append"), t_launched
    assert torch.equal(pk.view(torch.int16), t_pk.view(torch.int16))
    assert torch.equal(pv.view(torch.int16), t_pv.view(torch.int16))
    assert torch.equal(out.view(torch.int16), t_out.view(torch.int16))
    assert not torch.equal(pk, pools[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_the_quant_kernel_is_the_torch_formula(gpu, dispatched, dtype):
    """The INT8 entry points' quant kernel (tests/kernels/test_quant.py runs it on the host) against
    the torch formula it replaces, byte for byte: per token over a token-major view, per channel, an
    all-zero vector, ties to even, and values whose amax / 127 is below float32's least normal; then
    flash_attn_int8qk_quantized, one quant launch before the attention."""
    from rdnattention import flash_attn_int8qk_quantized, int8

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 40, 3, 72, generator=g) * 4).to(dtype).transpose(1, 2)
    x[0, 0, 0] = 0
    x[0, 0, 1, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5]).to(dtype)
    x[0, 1, 2] = torch.finfo(dtype).tiny if dtype != torch.float16 else 2.0**-24
    for quantize, dim in ((quantize_per_token, -1), (quantize_per_channel, 2)):
        start = len(gpu.dispatches)
        values, scales = quantize(x)
        assert [d.kernel for d in gpu.dispatches[start:]] == ["fa2_quant_upto512_nt1024_w32"]
        want_values, want_scales = int8._torch_quantize("x", x, dim)
        assert torch.equal(values, want_values) and torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
    if dtype == torch.float16:
        q, k, v = _inputs(1, 4, 2, 1, 90, 64, seed=5)
        start = len(gpu.dispatches)
        out = flash_attn_int8qk_quantized(q, k, v)
        assert [d.kernel.split("_")[1] for d in gpu.dispatches[start:]] == ["quant", "i8dec"]
        (qi, qs), (ki, ks), (vi, vs) = (int8._torch_quantize(n, t, d) for n, t, d in (("q", q, -1), ("k", k, -1),
                                                                                       ("v", v, 2)))
        assert torch.equal(out, flash_attn_int8qk(qi, ki, vi, qs, ks, vs))


def _kernels() -> list[str]:
    """Every gfx1100 kernel but the append and quant ones (run by their tests) and the backward's
    preprocess and dQ passes (run with their dK/dV kernel)."""
    return sorted(v.spec.name for v in MATRIX.variants_for(MATRIX.target(TARGET)) if v.spec.family not in ("append", "quant")
                  and not (v.spec.family == bwd.NAME and v.spec.option("layout")))


def _backward_set(gpu, name):
    """The dK/dV kernel ``name`` with the preprocess and dQ kernels of its tile and dtype, and the
    atomic passes of the same (pre, atomic, dqcast), forced by name, on a causal GQA call and a
    softcapped window (the forward: the oracle's, rounded as ours stores it), against the oracle's
    gradients."""
    spec = spec_from_name(name)
    dtype = torch.bfloat16 if spec.option("dtype") == "bf16" else torch.float16
    passes = {v.spec.option("layout"): v.spec.name for v in MATRIX.variants_for(MATRIX.target(TARGET))
              if v.spec.family == bwd.NAME and (v.spec.head_dim, v.spec.tile, v.spec.option("dtype"))
              == (spec.head_dim, spec.tile, spec.option("dtype"))}
    sets = (((passes["pre"], name, passes["dq"]), False), ((passes["pre"], passes["atomic"], passes["dqcast"]), True))
    for case, (hq, sq, options) in enumerate(((4, 45, {"is_causal": True}),
                                             (2, 33, {"is_causal": True, "window_size": (12, -1), "softcap": 2.0}),
                                             (2, 36, {"window_size": (11, 5),
                                                      "alibi_slopes": torch.tensor([0.3, 0.05])}))):
        q, k, v = _inputs(1, hq, 2, sq, sq, spec.head_dim, seed=spec.head_dim + case, dtype=dtype)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(case)).to(dtype)
        out, lse = attention_reference(q, k, v, return_lse=True, **options)
        refs = attention_gradients(q, k, v, dout, **options)
        left, right = options.get("window_size", (-1, -1))
        window = (left, 0 if options.get("is_causal") else right)
        for kernels, atomic in sets:
            start = len(gpu.dispatches)
            grads = ops.backward(dout, q, k, v, out.to(dtype), lse.float(), None, *window, spec.head_dim ** -0.5,
                                 options.get("softcap", 0.0), kernels=kernels, atomic=atomic,
                                 alibi_slopes=options.get("alibi_slopes"))
            assert [d.kernel for d in gpu.dispatches[start:]] == list(kernels)
            assert max(_grad_err(grads, refs)) <= GRAD_TOL[dtype]


@pytest.mark.slow  # every kernel by name; the entry-point paths above run in the fast suite
@pytest.mark.parametrize("name", _kernels())
def test_every_kernel_matches_the_oracle(gpu, dispatched, name):
    """Each gfx1100 kernel, forced by name, on a causal GQA case; the decode kernels with as many
    query rows per K/V head as their tile takes, split into three key slices (merged by the last
    to finish)."""
    spec = spec_from_name(name)
    if spec.family == bwd.NAME:  # with its preprocess and dQ passes
        return _backward_set(gpu, name)
    start = len(gpu.dispatches)
    table = route.device_table(torch.device("cpu"))
    layout = spec.option("layout")
    decode = spec.family in ("dec", "i8dec")
    rows = spec.tile.br if decode else 80  # query rows per K/V head, two K/V heads
    # 77 keys; a decode kernel of many keys per step (small head_dims) takes enough for three slices.
    keys = max(77, 2 * spec.tile.bc + 13) if decode and layout != "paged" else 77
    bf16 = spec.option("dtype") == "bf16"  # a bf16 kernel on bf16 inputs, within BF16_TOL
    q, k, v = _inputs(1, 2 if rows == 1 else 4, 2, max(1, rows // 2), keys, spec.head_dim, seed=spec.head_dim,
                      dtype=torch.bfloat16 if bf16 else torch.float16)
    # A score option's kernels serve only calls with its transforms: ALiBi slopes, or a softcap and sinks.
    g = torch.Generator().manual_seed(spec.head_dim)
    score = {"alibi": {"alibi_slopes": torch.rand(q.shape[1], generator=g)},
             "xf": {"softcap": 4.0, "sinks": torch.randn(q.shape[1], generator=g)}}.get(spec.option("score"), {})
    ref = attention_reference(q, k, v, is_causal=True, **score)
    if spec.family in ("i8", "i8dec"):
        (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
        start = len(gpu.dispatches)  # after the quant kernel's launches (test_the_quant_kernel_is_the_torch_formula)
        plan = plan_flash_attn_int8qk(qi, ki, vi, qs, ks, vs, is_causal=True, kernel=name)
        ref = attention_reference(*_dequantized(qi, qs, ki, ks, vi, vs), is_causal=True)
    elif layout == "varlen":  # the batch as one packed sequence pair
        cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (q.shape[2], k.shape[2]))
        plan = f16.plan(table, f16.Call(q=q, k=k, v=v, out=torch.zeros_like(q), lse=None, window=(-1, 0),
                                         softmax_scale=spec.head_dim ** -0.5, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                         batch=1, seq_q=q.shape[2], seq_k=k.shape[2], kernel=name, **score))
    elif decode:
        call = dict(q=q, k=k, v=v, out=torch.empty_like(q), lse=torch.empty(q.shape[:3]), window=(-1, 0),
                    softmax_scale=spec.head_dim ** -0.5, batch=1, seq_q=q.shape[2], seq_k=k.shape[2],
                    num_splits=3)
        if layout == "paged":  # five pages of 16 keys, in a shuffled order
            order = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
            pad = lambda t: torch.nn.functional.pad(t, (0, 0, 0, 80 - t.shape[2]))  # noqa: E731
            pool = lambda t: torch.zeros(5, 16, 2, spec.head_dim, dtype=t.dtype).index_copy_(  # noqa: E731
                0, order.long(), pad(t).transpose(1, 2).reshape(5, 16, 2, spec.head_dim)).transpose(1, 2)
            call.update(k=pool(k), v=pool(v), block_table=order.view(1, 5), seq_k=80,
                        seqused_k=torch.tensor([77], dtype=torch.int32))
        plan = dec.plan(table, dec.Call(**call), kernel=name)
    else:
        seqused = torch.tensor([77], dtype=torch.int32) if layout == "len" else None
        plan = plan_flash_attn(q, k, v, is_causal=True, kernel=name, seqused_k=seqused, **score)
    plan.run()
    ran = [d.kernel for d in gpu.dispatches[start:]]
    assert ran == [name]
    if spec.family == "dec":  # three slices asked for, as many as whole steps of the keys give: at least two
        assert plan.launches[0].args.splits == dec.slices(call["seq_k"], spec.tile.bc, 3) > 1
    if spec.family.startswith("i8"):
        assert _rel_rms(plan.outputs[0], ref) <= INT8_REL_RMS
    else:
        assert _max_err(plan.outputs[0], ref) <= (BF16_TOL if bf16 else TOL)


def test_transformers_attention_express_launches_the_kernel(gpu, dispatched, monkeypatch):
    """transformers' attention function on a repeated decode geometry: from the fifth call, its
    replay's express function (replay.express) rewrites the launch's fields and launches the split-KV
    kernel itself, with its slices' scratch from the workspace; the result is the oracle's."""
    from types import SimpleNamespace

    from rdnattention.integrations import transformers as rt
    monkeypatch.setattr(rt, "_express", replay.LastExpress())
    served = counted_express(monkeypatch)
    module = SimpleNamespace(is_causal=True, training=False)
    for seed in range(6):
        q, k, v = _inputs(1, 4, 2, 1, 700, 128, seed=seed)
        start = len(gpu.dispatches)
        out = rt.attention_forward(module, q, k, v, None, scaling=128 ** -0.5)[0]
        assert _families(gpu, start) == ["fa2_dec"] and gpu.dispatches[start].grid[0] > 1  # split into slices
        assert _max_err(out.transpose(1, 2), attention_reference(q, k, v)) <= TOL
    assert served == [True, True]  # the fifth and sixth calls


def test_transformers_attention_express_follows_a_growing_cache(gpu, dispatched, monkeypatch):
    """Decode steps on a cache one key longer per step, two layers a step: the express follows each
    new length (replay.follow: the key slices and the K/V strides rewritten) and launches the
    split-KV kernel through the HIP driver with no key built; each result is the oracle's."""
    from types import SimpleNamespace

    from rdnattention import ops
    from rdnattention.integrations import transformers as rt
    fresh_replays(monkeypatch)
    monkeypatch.setattr(rt, "_express", replay.LastExpress())
    module = SimpleNamespace(is_causal=True, training=False)
    keyed = []
    key = ops.key
    for n in range(700, 706):
        if n == 703:  # planned, followed, the entry's guard made, the express made
            monkeypatch.setattr(ops, "key", lambda *a, **kw: keyed.append(n) or key(*a, **kw))
        for layer in range(2):
            q, k, v = _inputs(1, 4, 2, 1, n, 128, seed=10 * n + layer)
            start = len(gpu.dispatches)
            out = rt.attention_forward(module, q, k, v, None, scaling=128 ** -0.5)[0]
            assert _families(gpu, start) == ["fa2_dec"] and gpu.dispatches[start].grid[0] > 1
            assert _max_err(out.transpose(1, 2), attention_reference(q, k, v)) <= TOL
    assert not keyed  # the last three steps through the express alone


@pytest.mark.parametrize("rope, splits", [(None, 0), (True, 0), (True, 2)], ids=["copy", "rope", "rope_split"])
def test_kvcache_express_launches_the_fused_append(gpu, dispatched, monkeypatch, rope, splits):
    """flash_attn_with_kvcache on a repeated geometry, the lengths' values unread (RDNATTENTION_CHECK=0,
    as GPU tensors' are by default): from the fifth call its replay's express launches the paged
    split-KV decode with the append fused into it through the HIP driver (with RoPE tables the rotated
    queries in a region of the workspace, the append reading q through q_src); its output and pool
    writes are, byte for byte, those of the same call planned from scratch; with key slices, their
    scratch before that region."""
    from rdnattention import checks, kvcache
    monkeypatch.setattr(checks, "_mode", "never")
    fresh_replays(monkeypatch)
    monkeypatch.setattr(kvcache, "_express", replay.LastExpress(()))
    served = counted_express(monkeypatch)

    def call(seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 1, 4, 64, generator=g).half()
        pk, pv = (torch.randn(6, 16, 2, 64, generator=g).half() for _ in range(2))
        k, v = (torch.randn(2, 1, 2, 64, generator=g).half() for _ in range(2))
        kwargs = dict(cache_seqlens=torch.tensor([30, 3], dtype=torch.int32), causal=True,
                      block_table=torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32), num_splits=splits)
        if rope is not None:
            kwargs["rotary_cos"], kwargs["rotary_sin"] = rotary_tables(40, 48)
        start = len(gpu.dispatches)
        out = flash_attn_with_kvcache(q, pk, pv, k, v, **kwargs)
        (launched,) = [d.kernel for d in gpu.dispatches[start:]]
        assert launched.startswith("fa2_decpaged_"), launched
        return out, pk, pv
    for seed in range(4):  # planned; replayed; its guard made; its express made
        call(seed)
    assert not served
    assert bool(replay.current(replay._guard.key).scratch_bytes) == bool(splits)
    got = call(4)
    assert served == [True]
    replay.clear()
    fresh = call(4)  # planned from scratch (the express refused it: its guard is no longer the current one)
    assert served == [True, False]
    for a, b in zip(got, fresh):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
