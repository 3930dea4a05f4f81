"""The cuda platform: cubins built and audited on any machine; run on a GPU where one is present."""

import math

import pytest
import torch
from cases import (BF16_LSE_TOL, BF16_TOL, HEAD_DIMS, LSE_TOL, MATRIX, TOL, VARIANTS, bf16_head_dims, make_case,
                   run_case)

from rdnattention import (attention_reference, flash_attn, flash_attn_varlen_func, flash_attn_with_kvcache,
                          rotary_tables, route, varlen_attn)
from rdnattention.errors import UnsupportedError
from rdnattention.reference import rotate
from rdnattention_gen import build, kernel_audit, toolchain
from rdnattention_gen.families import family

INT8_KERNELS = ("fa2_i8_", "fa2_i8dec_")  # both products through dot4: the INT8 family and its decode

# sm_60 builds sm_61's kernels less the int8 ones (test_sm_60_builds_pascals_kernels_without_int8),
# from the same sources and tiles: compiling it too would add a third of the time and no code.
CUDA_TARGETS = ["sm_90", "sm_61"]


@pytest.fixture(scope="module")
def cuda_build(matrix, tmp_path_factory):
    """The CUDA targets at head_dim 64 (Matrix.narrowed: every family and lowering), in a
    directory of their own. Their full builds' rows are docs/hardware.md's, held to the digest of
    their sources (test_docs.py); the GPU tests run sm_90's full build."""
    m = matrix.narrowed((64,), CUDA_TARGETS)
    out = tmp_path_factory.mktemp("cuda")
    return m, out, build.build(m, [m.target(n) for n in CUDA_TARGETS], out, log=lambda *_: None)


@pytest.fixture(scope="module")
def cuda_audit(cuda_build):
    m, _, rows = cuda_build
    return rows, {n: sorted(s.name for s in m.specs_for(m.target(n))) for n in CUDA_TARGETS}


def test_audit_table_prints_cuda_rows(cuda_build):
    """`rdnattention-gen audit`'s table (build.audit_target, then kernel_audit.table) of a CUDA build:
    a row per kernel, with its registers and occupancy from ptxas."""
    try:
        toolchain.find_ptxas("sm_90")
    except toolchain.ToolchainError as e:
        pytest.skip(str(e))
    m, out, _ = cuda_build
    target = m.target("sm_90")
    lines = [line.split() for line in kernel_audit.table(build.audit_target(m, target, out)).splitlines()[2:]]
    assert len(lines) == len(m.specs_for(target))
    assert all(cells[0] == "sm_90" and int(cells[2]) > 0 and int(cells[7]) >= 1 for cells in lines)


@pytest.mark.parametrize("target", CUDA_TARGETS)
def test_cuda_targets_build_without_spills(matrix, cuda_audit, target):
    try:
        toolchain.find_ptxas(target)
    except toolchain.ToolchainError as e:
        pytest.skip(str(e))
    rows = [r for r in cuda_audit[0] if r.target == target]
    assert sorted(r.name for r in rows) == cuda_audit[1][target]
    budget = matrix.target(target).lds_bytes
    for r in rows:
        assert (r.vgpr_spills, r.scratch_bytes) == (0, 0), r
        assert r.lds_bytes <= budget, r
        # bf16 widened by a shift (cvt.f32.bf16), copies and float64 RoPE (the cache append), the
        # INT8 quantization, or the backward's dQ cast from its fp32 sum: no fp16 conversions to count
        if not r.name.startswith(("fa2_append_", "fa2_quant_", "fa2_bwddqcast_")) and "_bf16_" not in r.name:
            assert (r.dot4 if r.name.startswith(INT8_KERNELS) else r.cvt_f32_f16) > 0, r
    # sm_90 converts each fp16 (and bf16) value once into fp32 LDS; Pascal, with 48 KiB, keeps fp16
    # (bf16) pairs.
    fp16 = [r for r in rows if r.name.startswith("fa2_f16_") and "_bf16_" not in r.name]
    bf16 = [r for r in rows if r.name.startswith(("fa2_f16_bf16_", "fa2_f16len_bf16_", "fa2_f16varlen_bf16_"))]
    assert fp16 and bf16
    assert all(r.name.endswith("_sf32" if target == "sm_90" else "_sf16") for r in fp16)
    assert all(r.name.endswith("_shift_fma_sf32" if target == "sm_90" else "_shift_fma_sbf16") for r in bf16)
    assert any(r.name.startswith("fa2_i8_") for r in rows)  # dp4a


def test_sm_60_builds_pascals_kernels_without_int8(matrix):
    """sm_60 (no dp4a) has the kernels of sm_61, its tiles and its staging, less the int8 ones (their
    quantization included)."""
    sm60, sm61 = matrix.target("sm_60"), matrix.target("sm_61")
    assert (sm60.tiles, sm60.stage, sm60.platform) == (sm61.tiles, sm61.stage, sm61.platform)
    names60 = {s.name for s in matrix.specs_for(sm60)}
    names61 = {s.name for s in matrix.specs_for(sm61)}
    int8 = {n for n in names61 if n.startswith(INT8_KERNELS + ("fa2_quant_",))}
    assert int8 and names60 == names61 - int8


# ----------------------------------------------------------------------------- on a GPU

def _gpu():
    if not torch.cuda.is_available() or torch.version.hip is not None:
        pytest.skip("needs an NVIDIA GPU")
    return torch.device("cuda")


def _torch_attention(q, k, v, options):
    """torch's own attention in fp32 (math path), with our masks and RoPE made explicit; with score
    transforms, torch's fp32 operations written out (sdpa takes no softcap nor sink)."""
    q32, k32, v32 = (t.float() for t in (q, k, v))
    sq, sk = q.shape[2], k.shape[2]
    if "rotary_cos" in options:
        cos, sin, inter = options["rotary_cos"], options["rotary_sin"], options.get("rotary_interleaved", False)
        q32 = rotate(q32.double(), cos, sin, torch.arange(sq) + sk - sq, inter).float()
        k32 = rotate(k32.double(), cos, sin, torch.arange(sk), inter).float()
    group = q.shape[1] // k.shape[1]
    k32, v32 = k32.repeat_interleave(group, 1), v32.repeat_interleave(group, 1)
    left, right = options.get("window_size", (-1, -1))
    if options.get("is_causal"):
        right = 0 if right < 0 else min(right, 0)
    diag = torch.arange(sq).unsqueeze(1) + sk - sq
    key = torch.arange(sk).unsqueeze(0)
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        mask &= key >= diag - left
    if right >= 0:
        mask &= key <= diag + right
    if any(options.get(name) is not None for name in ("softcap", "alibi_slopes", "sinks")):
        scale = options.get("softmax_scale") or 1 / math.sqrt(q.shape[3])
        s = q32 @ k32.transpose(2, 3) * scale
        if options.get("softcap"):
            s = options["softcap"] * torch.tanh(s / options["softcap"])
        slopes = options.get("alibi_slopes")
        if slopes is not None:
            slopes = slopes.float().expand(q.shape[0], q.shape[1])
            s = s - slopes[:, :, None, None] * (diag - key).abs().to(s.device)
        s = s.masked_fill(~mask.to(s.device), -math.inf)
        sinks = options.get("sinks")
        if sinks is not None:
            s = torch.cat([s, sinks.float()[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :sk]  # a row that sees nothing (no sink): zero
        return p @ v32
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask.to(q32.device),
                                                                scale=options.get("softmax_scale"))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gpu_matches_oracle_and_torch(head_dim, variant):
    device = _gpu()
    q, k, v, options = make_case(variant, head_dim)
    gpu_options = {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in options.items()}
    qd, kd, vd = q.to(device), k.to(device), v.to(device)
    score = family("f16").oracle_cases[variant].score
    table = route.device_table(device)
    if score and head_dim not in table.head_dims("f16", score=score) + table.head_dims("dec"):
        # A score transform where neither its row-block kernels nor the split-KV kernels are built
        # (head_dim above 256): refused, naming the head_dim, with the inputs untouched.
        before = [t.clone() for t in (qd, kd, vd)]
        with pytest.raises(UnsupportedError, match=f"head_dim {head_dim}"):
            flash_attn(qd, kd, vd, return_lse=True, **gpu_options)
        assert all(torch.equal(a, b) for a, b in zip(before, (qd, kd, vd)))
        return
    out, lse = flash_attn(qd, kd, vd, return_lse=True, **gpu_options)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    assert torch.isfinite(out).all()
    assert (out.cpu().double() - ref).abs().max().item() <= TOL
    assert (lse.cpu().double() - ref_lse).abs().max().item() <= LSE_TOL
    peer = _torch_attention(qd, kd, vd, gpu_options)
    assert (out.float() - peer).abs().max().item() <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim", bf16_head_dims("f16"))
def test_gpu_bf16_matches_oracle_and_torch(head_dim, variant):
    """bf16 q, k, v (the bf16 kernels, fp32 pairs staged on sm_90): a bf16 output within BF16_TOL
    of the oracle on the same bf16 values (tests/cases.py), its LSE within BF16_LSE_TOL, and of torch."""
    device = _gpu()
    q, k, v, options = make_case(variant, head_dim, dtype="bf16")
    gpu_options = {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in options.items()}
    qd, kd, vd = q.to(device), k.to(device), v.to(device)
    out, lse = flash_attn(qd, kd, vd, return_lse=True, **gpu_options)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    assert torch.isfinite(out).all()
    assert (out.cpu().double() - ref).abs().max().item() <= BF16_TOL
    assert (lse.cpu().double() - ref_lse).abs().max().item() <= BF16_LSE_TOL
    peer = _torch_attention(qd, kd, vd, gpu_options)
    assert (out.float() - peer).abs().max().item() <= BF16_TOL


# Every case of every family the bf16 kernels are built for (layouts included: cache lengths, packed
# batches, paged caches, key slices merged) on the GPU, through the sweep's entry points
# (tests/cases.py run_case) with the tensors moved to it.
BF16_CASES = [(fam, case, hd) for fam in ("f16", "dec") for case in family(fam).oracle_cases
              for hd in bf16_head_dims(fam)[::2]]


def _entry_points_on_gpu(monkeypatch, device):
    """run_case builds CPU tensors and calls the entry points: run them on the GPU instead."""
    import rdnattention as rdna

    for name in ("flash_attn", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        real = getattr(rdna, name)

        def on_gpu(*args, _real=real, **kwargs):
            move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
            out = _real(*map(move, args), **{k: move(x) for k, x in kwargs.items()})
            return tuple(x.cpu() if isinstance(x, torch.Tensor) else x for x in out)

        monkeypatch.setattr("cases." + name, on_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("fam,case,head_dim", BF16_CASES)
def test_gpu_bf16_every_family_matches_the_oracle(monkeypatch, fam, case, head_dim):
    device = _gpu()
    _entry_points_on_gpu(monkeypatch, device)
    out, lse, ref, ref_lse, _ = run_case(fam, case, head_dim, "bf16")
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() <= BF16_TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= BF16_LSE_TOL


# The f16 family's ALiBi cases (score option alibi: plain, cache lengths, packed batches; causal,
# windows, GQA, MQA, sinks) at every head_dim its alibi kernels are built for, in fp16 and bf16.
ALIBI_CASES = [(case, hd, dtype) for case, c in family("f16").oracle_cases.items() if c.score == "alibi"
               for hd in MATRIX.kernels["f16"].get("scores", {}).get("alibi", ()) for dtype in ("fp16", "bf16")]


@pytest.mark.gpu
@pytest.mark.parametrize("case,head_dim,dtype", ALIBI_CASES)
def test_gpu_alibi_prefill_runs_the_alibi_row_block_kernels(monkeypatch, case, head_dim, dtype):
    """An ALiBi prefill runs the row-block kernels compiled with ALiBi (not the split-KV ones) on the
    GPU and matches the oracle."""
    from rdnattention import replay, route

    device = _gpu()
    _entry_points_on_gpu(monkeypatch, device)
    ran = []
    plan = route.plan
    monkeypatch.setattr(route, "plan", lambda table, call: ran.append(plan(table, call)) or ran[-1])
    monkeypatch.setattr(replay, "cache", {})
    out, lse, ref, ref_lse, _ = run_case("f16", case, head_dim, dtype)
    kernels = {launch.kernel for p in ran for launch in p.launches}
    assert kernels and all((k.family, k.score) == ("f16", "alibi") for k in kernels), kernels
    tol, lse_tol = (TOL, LSE_TOL) if dtype == "fp16" else (BF16_TOL, BF16_LSE_TOL)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max().item() <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= lse_tol


@pytest.mark.gpu
def test_gpu_offsets_beyond_2_31_elements():
    device = _gpu()
    # One buffer of 2^31 + 2^20 elements; batch 1 of each view starts at element 2^31.
    batch_stride = 2**31
    try:
        buf = torch.empty(batch_stride + 2**20, dtype=torch.float16, device=device)
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 4 GiB buffer")
    g = torch.Generator(device=device).manual_seed(0)
    seq, dim, heads = 96, 128, 2
    views = []
    for i in range(3):
        t = torch.as_strided(buf, (2, heads, seq, dim), (batch_stride, seq * dim, dim, 1), i * heads * seq * dim)
        t.copy_(torch.randn(2, heads, seq, dim, generator=g, device=device, dtype=torch.float16))
        views.append(t)
    q, k, v = views
    out = flash_attn(q, k, v, is_causal=True)
    ref = attention_reference(q.cpu(), k.cpu(), v.cpu(), is_causal=True)
    assert (out.cpu().double() - ref).abs().max().item() <= TOL


@pytest.mark.gpu
def test_gpu_runs_on_the_current_stream():
    device = _gpu()
    q, k, v, _ = make_case("gqa", 128)
    qd, kd, vd = q.to(device), k.to(device), v.to(device)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = flash_attn(qd, kd, vd, is_causal=True)
    stream.synchronize()
    ref = attention_reference(q, k, v, is_causal=True)
    assert (out.cpu().double() - ref).abs().max().item() <= TOL
    assert not math.isnan(out.float().sum().item())


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    device = _gpu()
    q, k, v, _ = make_case("gqa", 128)
    qd, kd, vd = q.to(device), k.to(device), v.to(device)

    def layer(q, k, v):
        return flash_attn(q, k, v, is_causal=True) * 2

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(qd, kd, vd), layer(qd, kd, vd))
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_fwd.default,
                          (qd, kd, vd, None, None, -1, 0, 0.1, False, True, False),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    device = _gpu()
    q, k, v, _ = make_case("decode", 128, "dec")
    qd, kd, vd = q.to(device), k.to(device), v.to(device)
    with torch.inference_mode():
        flash_attn(qd, kd, vd)  # loads the module before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flash_attn(qd, kd, vd)
        for scale in (1.0, 0.5):
            qd.copy_(q.to(device) * scale)
            graph.replay()
            torch.cuda.synchronize()
            ref = attention_reference((q.double() * scale).half(), k, v)
            assert (out.cpu().double() - ref).abs().max().item() <= TOL


@pytest.mark.gpu
def test_gpu_nan_scores_make_their_rows_nan():
    device = _gpu()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 300, 128, generator=g).half() for _ in range(3))
    k[0, 0, 250, 7] = float("nan")  # head 0: rows 250.. see key 250 under the causal mask
    q[0, 1, 10, 3] = float("nan")   # head 1: row 10 only
    out, lse = flash_attn(q.to(device), k.to(device), v.to(device), is_causal=True, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, is_causal=True, return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    nan_rows = ref_lse[0].isnan()
    assert nan_rows.sum() == 51 and torch.equal(lse[0].isnan(), nan_rows)
    assert torch.equal(out[0].isnan().all(-1), nan_rows) and not out[0][~nan_rows].isnan().any()
    assert (out[0][~nan_rows].double() - ref[0][~nan_rows]).abs().max().item() <= TOL


@pytest.mark.gpu
def test_gpu_tensors_refuse_a_forced_host_target(monkeypatch):
    from rdnattention import dispatch
    from rdnattention.errors import UnsupportedError
    device = _gpu()
    monkeypatch.setenv("RDNATTENTION_TARGET", "host")
    dispatch.table_for.cache_clear()
    q = torch.randn(1, 2, 8, 64, device=device).half()
    with pytest.raises(UnsupportedError, match="RDNATTENTION_TARGET=host names a target of platform host, but "
                                               "tensors on cuda:0 run on cuda targets"):
        flash_attn(q, q, q)
    dispatch.table_for.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("fam,variant", [(f, c) for f in ("i8", "i8dec") for c in family(f).oracle_cases])
def test_gpu_int8_matches_the_dequantized_oracle(head_dim, fam, variant):
    from rdnattention import flash_attn_int8qk, quantize_per_channel, quantize_per_token
    device = _gpu()
    q, k, v, options = make_case(variant, head_dim, fam)
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
    out, lse = flash_attn_int8qk(*(t.to(device) for t in (qi, ki, vi, qs, ks, vs)), return_lse=True, **options)
    ref, ref_lse = attention_reference(qi.double() * qs.double()[..., None], ki.double() * ks.double()[..., None],
                                       vi.double() * vs.double()[:, :, None, :], return_lse=True, **options)
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() <= 0.03
    assert (lse.cpu().double() - ref_lse).abs().max().item() <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128, 512])
def test_gpu_the_quant_kernel_is_the_torch_formula(dtype, head_dim):
    """The quant kernel on the GPU against the torch formula on the GPU (its CUDA reduction and
    division) and on the CPU, byte for byte: contiguous and token-major inputs, per token and per channel, an
    all-zero vector, ties to even and a sub-normal amax / 127; then flash_attn_int8qk_quantized
    (one quant launch) against flash_attn_int8qk on the formula's quantization."""
    from rdnattention import flash_attn_int8qk, flash_attn_int8qk_quantized, int8, quantize_per_channel, quantize_per_token
    device = _gpu()
    g = torch.Generator().manual_seed(head_dim)
    x = (torch.randn(2, 300, 3, head_dim, generator=g) * 4).to(dtype)
    x[0, 0, 0] = 0
    x[0, 1, 0, : min(head_dim, 4)] = torch.tensor([127.0, 2.5, -3.5, 0.5])[: min(head_dim, 4)].to(dtype)
    x[0, 2, 1] = torch.finfo(dtype).tiny if dtype != torch.float16 else 2.0**-24
    x = x.to(device)
    start = int8.counts()["quantize_kernel"]
    for view in (x.transpose(1, 2), x.transpose(1, 2).contiguous()):
        for quantize, dim in ((quantize_per_token, -1), (quantize_per_channel, 2)):
            values, scales = quantize(view)
            for formula_on in (view, view.cpu()):  # the formula by torch's CUDA and CPU operations
                want_values, want_scales = int8._torch_quantize("x", formula_on, dim)
                assert torch.equal(values.cpu(), want_values.cpu())
                assert torch.equal(scales.view(torch.int32).cpu(), want_scales.view(torch.int32).cpu())
    assert int8.counts()["quantize_kernel"] == start + 4
    if dtype == torch.float16 and head_dim in (64, 128):
        for seq_q in (1, 300):
            q = x.transpose(1, 2)[:, :, :seq_q].repeat(1, 2, 1, 1)
            k = v = x.transpose(1, 2)
            out = flash_attn_int8qk_quantized(q, k, v, is_causal=seq_q > 1)
            (qi, qs), (ki, ks), (vi, vs) = (int8._torch_quantize(n, t, d) for n, t, d in (("q", q, -1), ("k", k, -1),
                                                                                           ("v", v, 2)))
            assert torch.equal(out, flash_attn_int8qk(qi, ki, vi, qs, ks, vs, is_causal=seq_q > 1))
            assert torch.equal(flash_attn_int8qk_quantized(q, k, v, is_causal=seq_q > 1), out)  # replayed


@pytest.mark.gpu
@pytest.mark.parametrize("sq", [1, 5])
def test_gpu_cache_lengths(sq):
    device = _gpu()
    g = torch.Generator().manual_seed(sq)
    q = torch.randn(3, 8, sq, 128, generator=g).half()
    k, v = (torch.randn(3, 2, 300, 128, generator=g).half() for _ in range(2))
    seqused = torch.tensor([300, 77, 0], dtype=torch.int32)
    out, lse = flash_attn(q.to(device), k.to(device), v.to(device), is_causal=True, seqused_k=seqused.to(device),
                          return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, is_causal=True, seqused_k=seqused, return_lse=True)
    assert (out.cpu().double() - ref).abs().max().item() <= TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert (lse.cpu().double()[finite] - ref_lse[finite]).abs().max().item() <= LSE_TOL


@pytest.mark.gpu
def test_gpu_kvcache_decode_step():
    from rdnattention import flash_attn_with_kvcache
    device = _gpu()
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 1, 8, 128, generator=g).half()
    k_cache, v_cache = (torch.randn(2, 256, 2, 128, generator=g).half() for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 128, generator=g).half() for _ in range(2))
    lengths = torch.tensor([100, 3], dtype=torch.int32)
    kc, vc = k_cache.to(device), v_cache.to(device)
    out = flash_attn_with_kvcache(q.to(device), kc, vc, k.to(device), v.to(device), cache_seqlens=lengths.to(device),
                                  causal=True)
    k_cache[0, 100], k_cache[1, 3], v_cache[0, 100], v_cache[1, 3] = k[0, 0], k[1, 0], v[0, 0], v[1, 0]
    assert torch.equal(kc.cpu(), k_cache) and torch.equal(vc.cpu(), v_cache)
    ref = attention_reference(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), is_causal=True,
                              seqused_k=lengths + 1)
    assert (out.cpu().double() - ref.transpose(1, 2)).abs().max().item() <= TOL


@pytest.mark.gpu
def test_gpu_paged_decode_step_replays_as_a_cuda_graph():
    """A decode step on a paged cache (append, then attention through the block table, split-KV with
    its slices merged) captured once and replayed with new tokens and lengths: the same as eager calls."""
    device = _gpu()
    g = torch.Generator().manual_seed(7)
    b, hq, hk, d, page, pages_per_seq = 2, 8, 2, 128, 16, 16
    pool_k, pool_v = (torch.randn(b * pages_per_seq, page, hk, d, generator=g).half().to(device) for _ in range(2))
    table = torch.randperm(b * pages_per_seq, generator=g).to(torch.int32).view(b, pages_per_seq).to(device)
    q = torch.randn(b, 1, hq, d, generator=g).half().to(device)
    k_new, v_new = (torch.randn(b, 1, hk, d, generator=g).half().to(device) for _ in range(2))
    lengths = torch.tensor([100, 37], dtype=torch.int32, device=device)

    def step():
        return flash_attn_with_kvcache(q, pool_k, pool_v, k_new, v_new, cache_seqlens=lengths, block_table=table,
                                       causal=True)

    step()  # eager: plans the call (later calls replay it), warms up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        q.copy_(torch.randn(q.shape, generator=g).half())
        k_new.copy_(torch.randn(k_new.shape, generator=g).half())
        v_new.copy_(torch.randn(v_new.shape, generator=g).half())
        lengths += 1
        saved = (pool_k.clone(), pool_v.clone())
        graph.replay()
        torch.cuda.synchronize()
        replayed = (out.clone(), pool_k.clone(), pool_v.clone())
        pool_k.copy_(saved[0])
        pool_v.copy_(saved[1])
        expected = step()
        assert torch.equal(replayed[1], pool_k) and torch.equal(replayed[2], pool_v)
        assert torch.equal(replayed[0], expected)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [0, 4])
def test_gpu_kvcache_express_matches_a_planned_call(monkeypatch, num_splits):
    """flash_attn_with_kvcache on one geometry, call after call (a decode step's layers): from the
    fifth call its replay's express launches it (GPU lengths are not read at the call), with the
    output and the pool writes, byte for byte, of the same call planned from scratch."""
    from cases import counted_express
    from rdnattention import kvcache, replay
    device = _gpu()
    monkeypatch.setattr(kvcache, "_express", replay.LastExpress(()))
    replay.clear()
    served = counted_express(monkeypatch)
    cos, sin = (t.to(device) for t in rotary_tables(512, 128))

    def call(seed):
        g = torch.Generator().manual_seed(seed)
        pool_k, pool_v = (torch.randn(32, 16, 2, 128, generator=g).half().to(device) for _ in range(2))
        table = torch.randperm(32, generator=g).to(torch.int32).view(2, 16).to(device)
        q = torch.randn(2, 1, 8, 128, generator=g).half().to(device)
        k, v = (torch.randn(2, 1, 2, 128, generator=g).half().to(device) for _ in range(2))
        lengths = torch.tensor([200, 37], dtype=torch.int32, device=device)
        out = flash_attn_with_kvcache(q, pool_k, pool_v, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths,
                                      block_table=table, causal=True, num_splits=num_splits)
        return out, pool_k, pool_v
    for seed in range(4):
        call(seed)
    assert kvcache._express.made
    tried = len(served)
    got = call(4)
    assert served[tried:] == [True] and kvcache._express.made  # tried, and kept: it served the call
    replay.clear()
    fresh = call(4)
    for a, b in zip(got, fresh):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_varlen_matches_the_oracle():
    device = _gpu()
    g = torch.Generator().manual_seed(8)
    lengths_q, lengths_k = [1, 7, 300, 0], [900, 7, 300, 5]
    q = torch.randn(sum(lengths_q), 8, 128, generator=g).half()
    k, v = (torch.randn(sum(lengths_k), 2, 128, generator=g).half() for _ in range(2))
    cu = [torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in (lengths_q, lengths_k)]
    out = varlen_attn(q.to(device), k.to(device), v.to(device), cu[0].to(device), cu[1].to(device), 300, 900,
                      window_size=(-1, 0), enable_gqa=True).cpu()
    view = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    for i in range(4):
        qs, ks = slice(int(cu[0][i]), int(cu[0][i + 1])), slice(int(cu[1][i]), int(cu[1][i + 1]))
        if qs.stop > qs.start:
            ref = attention_reference(view(q[qs]), view(k[ks]), view(v[ks]), is_causal=True)
            assert (view(out[qs]).double() - ref).abs().max().item() <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("lengths_q, lengths_k", [([1, 1, 1], [900, 7, 300]), ([300, 7, 64], [300, 900, 64])])
def test_gpu_varlen_rows_past_the_last_sequence_are_zero_without_a_fill(stale_decode_output, lengths_q, lengths_k):
    """q holds 37 rows past the last sequence: the kernels (split-KV for one row per sequence, row blocks for
    long ones) write them as zeros over an output whose memory held NaNs, and the sequences' rows as the oracle's."""
    device = _gpu()
    g = torch.Generator().manual_seed(9)
    q = torch.randn(sum(lengths_q) + 37, 8, 128, generator=g).half()
    k, v = (torch.randn(sum(lengths_k), 2, 128, generator=g).half() for _ in range(2))
    cu = [torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in (lengths_q, lengths_k)]
    out = flash_attn_varlen_func(q.to(device), k.to(device), v.to(device), cu[0].to(device), cu[1].to(device),
                                 max(lengths_q), max(lengths_k), causal=True).cpu()
    total = int(cu[0][-1])
    assert torch.equal(out[total:], torch.zeros_like(out[total:]))
    view = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    for i in range(3):
        qs, ks = slice(int(cu[0][i]), int(cu[0][i + 1])), slice(int(cu[1][i]), int(cu[1][i + 1]))
        ref = attention_reference(view(q[qs]), view(k[ks]), view(v[ks]), is_causal=True)
        assert (view(out[qs]).double() - ref).abs().max().item() <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_int8_decode_matches_the_oracle(head_dim):
    from rdnattention import flash_attn_int8qk, plan_flash_attn_int8qk, quantize_per_channel, quantize_per_token

    device = _gpu()
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 8, 1, head_dim, generator=g).half()
    k, v = (torch.randn(2, 2, 3000, head_dim, generator=g).half() for _ in range(2))
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
    args = [t.to(device) for t in (qi, ki, vi, qs, ks, vs)]
    assert plan_flash_attn_int8qk(*args).launches[0].kernel.family == "i8dec"
    out = flash_attn_int8qk(*args, is_causal=True).cpu()
    ref = attention_reference(qi.double() * qs.double()[..., None], ki.double() * ks.double()[..., None],
                              vi.double() * vs.double()[:, :, None, :], is_causal=True)
    assert (out.double() - ref).abs().max().item() <= TOL


# --- eager calls: no synchronisation, per-stream scratch (issue: eager calls as cheap as torch's) ---

def _entry_point_calls(device):
    """A call of every entry point and path on ``device``: (name, call), each a fresh geometry."""
    import rdnattention
    g = torch.Generator().manual_seed(11)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).half().to(device)

    def ints(*values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    q1, q4, kv = rnd(2, 8, 1, 128), rnd(2, 8, 4, 128), rnd(2, 2, 3000, 128)
    tq, tk = rnd(2, 1, 8, 128), rnd(2, 1, 2, 128)
    cache = rnd(2, 4096, 2, 128)
    pool = rnd(64, 128, 2, 128)
    table = torch.arange(64, dtype=torch.int32, device=device).view(2, 32)
    lengths = ints(3000, 17)
    cos, sin = rdnattention.rotary_tables(4096, 128, device=device)
    packed_q, packed_k = rnd(4, 8, 128), rnd(5000, 2, 128)
    cu_q, cu_k = ints(0, 1, 2, 3, 4), ints(0, 1000, 3000, 4000, 5000)
    rows, paged_cu_k = ints(1, 0), ints(0, 3000, 3017)  # made here: a copy from the host synchronises
    slopes = torch.rand(8, device=device)  # values not read on a GPU (checks.reads): no synchronisation
    sinks = torch.randn(8, device=device)
    (q8, qs), (k8, ks), (v8, vs) = (rdnattention.quantize_per_token(q1), rdnattention.quantize_per_token(kv),
                                    rdnattention.quantize_per_channel(kv))
    return [
        ("prefill", lambda: rdnattention.flash_attn(q4.repeat(1, 1, 64, 1), kv, kv, is_causal=True)),
        ("decode", lambda: rdnattention.flash_attn(q1, kv, kv)),
        ("decode 4 rows", lambda: rdnattention.flash_attn(q4, kv, kv)),
        ("seqused_k", lambda: rdnattention.flash_attn(q1, kv, kv, seqused_k=lengths)),
        ("flash_attn_func", lambda: rdnattention.flash_attn_func(tq, kv.transpose(1, 2), kv.transpose(1, 2))),
        ("sdpa", lambda: rdnattention.scaled_dot_product_attention(q1, kv, kv, enable_gqa=True)),
        ("kvcache", lambda: rdnattention.flash_attn_with_kvcache(tq, cache, cache, cache_seqlens=lengths)),
        ("kvcache append", lambda: rdnattention.flash_attn_with_kvcache(tq, cache, cache, tk, tk,
                                                                         cache_seqlens=lengths, causal=True)),
        ("kvcache rope", lambda: rdnattention.flash_attn_with_kvcache(tq, cache, cache, tk, tk, rotary_cos=cos,
                                                                       rotary_sin=sin, cache_seqlens=lengths)),
        ("kvcache int length", lambda: rdnattention.flash_attn_with_kvcache(tq, cache, cache, tk, tk,
                                                                             cache_seqlens=100)),
        ("kvcache rows", lambda: rdnattention.flash_attn_with_kvcache(tq, cache, cache, cache_seqlens=lengths,
                                                                       cache_batch_idx=rows)),
        ("kvcache paged", lambda: rdnattention.flash_attn_with_kvcache(tq, pool, pool, tk, tk, cache_seqlens=lengths,
                                                                        block_table=table)),
        ("varlen decode", lambda: rdnattention.varlen_attn(packed_q, packed_k, packed_k, cu_q, cu_k, 1, 2000,
                                                           enable_gqa=True)),
        ("varlen prefill", lambda: rdnattention.flash_attn_varlen_func(packed_k[:, :1].repeat(1, 8, 1), packed_k,
                                                                       packed_k, cu_k, cu_k, 2000, 2000,
                                                                       causal=True)),
        ("varlen paged", lambda: rdnattention.flash_attn_varlen_func(packed_q[:2], pool, pool, cu_q[:3],
                                                                     paged_cu_k, 1, 4096,
                                                                     block_table=table)),
        ("softcap", lambda: rdnattention.flash_attn(q4.repeat(1, 1, 64, 1), kv, kv, is_causal=True, softcap=30.0)),
        ("alibi", lambda: rdnattention.flash_attn(q1, kv, kv, alibi_slopes=slopes)),
        ("sinks split", lambda: rdnattention.flash_attn_with_kvcache(tq, cache, cache, cache_seqlens=lengths,
                                                                      num_splits=4, sinks=sinks)),
        ("sinks varlen", lambda: rdnattention.flash_attn_varlen_func(packed_k[:, :1].repeat(1, 8, 1), packed_k,
                                                                     packed_k, cu_k, cu_k, 2000, 2000, causal=True,
                                                                     sinks=sinks, alibi_slopes=slopes)),
        ("int8", lambda: rdnattention.flash_attn_int8qk(q8, k8, v8, qs, ks, vs)),
        ("int8 quantized", lambda: rdnattention.flash_attn_int8qk_quantized(q4, kv, kv)),
    ]


@pytest.mark.gpu
def test_gpu_no_entry_point_synchronises_in_eager_mode():
    """Every path, planned (first call of its geometry) and replayed (the second), under torch's
    sync debug mode: a device-to-host read (a value check, .item(), .tolist()) raises."""
    device = _gpu()
    with torch.inference_mode():
        x = torch.randn(1, 2, 1, 128, device=device).half()
        flash_attn(x, x, x)  # loads the code object
        torch.cuda.synchronize()
        calls = _entry_point_calls(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for name, call in calls:
                for _ in range(2):
                    call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_split_kv_calls_on_two_streams_at_once_keep_their_scratch_apart():
    """Split-KV decode calls in a loop on two streams at once (each stream's workspace), and a
    graph of such a call replayed on a third: every output equals the call made alone."""
    device = _gpu()
    g = torch.Generator().manual_seed(12)
    qs = [torch.randn(1, 32, 1, 128, generator=g).half().to(device) for _ in range(3)]
    k, v = (torch.randn(1, 8, 16384, 128, generator=g).half().to(device) for _ in range(2))
    with torch.inference_mode():
        alone = [flash_attn(q, k, v) for q in qs]
        assert split_slices(qs[0], k, v) > 1  # several slices: the scratch and the counters are in play
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = flash_attn(qs[2], k, v)
        torch.cuda.synchronize()
        streams = [torch.cuda.Stream() for _ in range(3)]
        outs: list[list] = [[], []]
        for _ in range(50):
            for i in range(2):
                with torch.cuda.stream(streams[i]):
                    outs[i].append(flash_attn(qs[i], k, v))
            with torch.cuda.stream(streams[2]):
                graph.replay()
        torch.cuda.synchronize()
        for i in range(2):
            assert all(torch.equal(o, alone[i]) for o in outs[i])
        assert torch.equal(captured, alone[2])
        from rdnattention import workspace
        # every launch left the counters it counted in at zero (the last slice of each chunk resets its own)
        assert workspace._gpu and not any(held[1].any() for held in workspace._gpu.values())


def split_slices(q, k, v) -> int:
    from rdnattention import plan_flash_attn
    plan = plan_flash_attn(q, k, v)
    assert len(plan.launches) == 1 and (plan.counters > 0) == (plan.launches[0].args.splits > 1)
    return plan.launches[0].args.splits


_HOSTILE_GPU = """
import torch, rdnattention
d = torch.device("cuda")
g = torch.Generator().manual_seed(0)
def rnd(*shape):
    return torch.randn(*shape, generator=g).half().to(d)
def ints(*values):
    return torch.tensor(values, dtype=torch.int32, device=d)
q, k, v = rnd(2, 1, 8, 128), rnd(2, 1, 2, 128), rnd(2, 1, 2, 128)
cache, pool = rnd(2, 256, 2, 128), rnd(8, 64, 2, 128)
bad = ints(2**31 - 1, -(2**31))
table = ints(-1, 10**9, 8, 3, 2**31 - 1, 0, 0, -5).view(2, 4)
cos, sin = rdnattention.rotary_tables(64, 128, device=d)
packed_q, packed_k = rnd(5, 8, 128), rnd(70, 2, 128)
calls = [
    lambda: rdnattention.flash_attn_with_kvcache(q, cache, cache, k, v, cache_seqlens=bad, causal=True),
    lambda: rdnattention.flash_attn_with_kvcache(q, cache, cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                                 cache_seqlens=ints(255, -3)),
    lambda: rdnattention.flash_attn_with_kvcache(q, cache, cache, k, v, cache_seqlens=ints(3, 4), cache_batch_idx=bad),
    lambda: rdnattention.flash_attn_with_kvcache(q, pool, pool, k, v, cache_seqlens=ints(100, 200), block_table=table),
    lambda: rdnattention.flash_attn_with_kvcache(q, pool, pool, cache_seqlens=bad, block_table=table, num_splits=4),
    lambda: rdnattention.varlen_attn(packed_q, packed_k, packed_k, ints(0, 10**9, 5), ints(3, -40, 2**31 - 1), 4, 40,
                                     enable_gqa=True),
    lambda: rdnattention.varlen_attn(packed_q, packed_k, packed_k, ints(4, 1, -3), ints(70, 30, 0), 4, 40,
                                     enable_gqa=True, num_splits=3),
    lambda: rdnattention.flash_attn_varlen_func(packed_k[:, :1].repeat(1, 8, 1), packed_k, packed_k,
                                                ints(5, 1, 10**6), ints(-100, 50, 2**31 - 1), 64, 64, causal=True),
    lambda: rdnattention.flash_attn(rnd(2, 8, 4, 128), rnd(2, 2, 100, 128), rnd(2, 2, 100, 128), seqused_k=bad),
]
with torch.inference_mode():
    for call in calls:
        for _ in range(2):
            call()
    torch.cuda.synchronize()
    x = rnd(1, 2, 16, 128)
    print("ok", rdnattention.flash_attn(x, x, x).isfinite().all().item())
"""


@pytest.mark.gpu
def test_gpu_hostile_index_values_are_bounded_on_the_device():
    """The values a GPU call does not read, hostile: nothing faults (no illegal address, no
    device-side assertion from the cache append's indexing) and the context still serves calls."""
    import subprocess
    import sys

    from conftest import REPO_ROOT
    _gpu()
    out = subprocess.run([sys.executable, "-c", _HOSTILE_GPU], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok True"), out.stdout


def _score_options(batch, heads, seed):
    g = torch.Generator().manual_seed(seed)
    return dict(softcap=20.0, alibi_slopes=torch.rand(batch, heads, generator=g) * 0.05,
                sinks=torch.randn(heads, generator=g) + 2)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_splits", [0, 1, 3])  # automatic; one slice (the sink where rows are written); merged
@pytest.mark.parametrize("paged", [False, True])
def test_gpu_decode_score_transforms(head_dim, num_splits, paged):
    """softcap, ALiBi and sinks on the split-KV kernels (plain and paged caches, several slices merged) on the GPU."""
    device = _gpu()
    batch, hq, hk, cache_len, page = 2, 8, 2, 1024, 64
    g = torch.Generator().manual_seed(head_dim + num_splits)
    q = torch.randn(batch, 2, hq, head_dim, generator=g).half()
    k, v = (torch.randn(batch, cache_len, hk, head_dim, generator=g).half() for _ in range(2))
    lengths = torch.tensor([cache_len, 333], dtype=torch.int32)
    score = _score_options(batch, hq, head_dim)
    kw = {}
    kc, vc = k, v
    if paged:
        order = torch.randperm(batch * cache_len // page, generator=g).to(torch.int32)
        kw["block_table"] = order.view(batch, cache_len // page).to(device)
        kc, vc = (torch.empty_like(t.reshape(-1, page, hk, head_dim)).index_copy_(0, order.long(),
                                                                                  t.reshape(-1, page, hk, head_dim))
                  for t in (k, v))
    out, lse = flash_attn_with_kvcache(q.to(device), kc.to(device), vc.to(device), cache_seqlens=lengths.to(device),
                                       causal=True, num_splits=num_splits, return_softmax_lse=True,
                                       **{n: (t.to(device) if isinstance(t, torch.Tensor) else t)
                                          for n, t in score.items()}, **kw)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       seqused_k=lengths, return_lse=True, **score)
    assert (out.cpu().transpose(1, 2).double() - ref).abs().max().item() <= TOL
    assert (lse.cpu().double() - ref_lse).abs().max().item() <= LSE_TOL


@pytest.mark.gpu
def test_gpu_varlen_score_transforms():
    """The row-block kernels of packed batches (and the split-KV ones for a decode batch) with
    softcap, per-sequence ALiBi slopes and sinks."""
    device = _gpu()
    g = torch.Generator().manual_seed(9)
    for lengths_q, lengths_k in (([1, 7, 300, 0], [900, 7, 300, 5]), ([1, 1, 1, 1], [900, 7, 300, 5])):
        q = torch.randn(sum(lengths_q), 8, 128, generator=g).half()
        k, v = (torch.randn(sum(lengths_k), 2, 128, generator=g).half() for _ in range(2))
        cu = [torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in (lengths_q, lengths_k)]
        score = _score_options(4, 8, 9)
        out = flash_attn_varlen_func(q.to(device), k.to(device), v.to(device), cu[0].to(device), cu[1].to(device),
                                     max(lengths_q), 900, causal=True,
                                     **{n: (t.to(device) if isinstance(t, torch.Tensor) else t)
                                        for n, t in score.items()}).cpu()
        view = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
        for i in range(4):
            qs, ks = slice(int(cu[0][i]), int(cu[0][i + 1])), slice(int(cu[1][i]), int(cu[1][i + 1]))
            if qs.stop > qs.start:
                ref = attention_reference(view(q[qs]), view(k[ks]), view(v[ks]), is_causal=True,
                                          **dict(score, alibi_slopes=score["alibi_slopes"][i]))
                assert (view(out[qs]).double() - ref).abs().max().item() <= TOL


@pytest.mark.gpu
def test_gpu_gemma2_and_gpt_oss_rows():
    """Gemma 2's softcap at head_dim 256 over its sliding window, gpt-oss's sinks at head_dim 64 with
    its window, on the GPU against the oracle (tests/kernels/test_model_rows.py on the host)."""
    device = _gpu()
    g = torch.Generator().manual_seed(11)
    q = (torch.randn(1, 8, 512, 256, generator=g) * 4).half()
    k, v = (torch.randn(1, 4, 512, 256, generator=g).half() for _ in range(2))
    for window in ((-1, -1), (127, 0)):
        out, lse = flash_attn(q.to(device), k.to(device), v.to(device), is_causal=True, window_size=window,
                              softmax_scale=256 ** -0.5, softcap=50.0, return_lse=True)
        ref, ref_lse = attention_reference(q, k, v, is_causal=True, window_size=window, softmax_scale=256 ** -0.5,
                                           softcap=50.0, return_lse=True)
        assert (out.cpu().double() - ref).abs().max().item() <= TOL
        assert (lse.cpu().double() - ref_lse).abs().max().item() <= LSE_TOL
    q = torch.randn(2, 64, 300, 64, generator=g).half()
    k, v = (torch.randn(2, 8, 300, 64, generator=g).half() for _ in range(2))
    sinks = torch.randn(64, generator=g) * 2 + 2
    for rows in (300, 1):
        qs = q[:, :, -rows:].contiguous()
        out, lse = flash_attn(qs.to(device), k.to(device), v.to(device), is_causal=True, window_size=(127, 0),
                              sinks=sinks.to(device), return_lse=True)
        ref, ref_lse = attention_reference(qs, k, v, is_causal=True, window_size=(127, 0), sinks=sinks,
                                           return_lse=True)
        assert (out.cpu().double() - ref).abs().max().item() <= TOL
        assert (lse.cpu().double() - ref_lse).abs().max().item() <= LSE_TOL
