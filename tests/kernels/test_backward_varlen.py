"""The backward pass of packed sequences (flash_attn_varlen_func, varlen_attn and the packed forms
with inputs that require grad; rdnattention::flash_attn_varlen_bwd): every host backward kernel
set, both modes, against the float64 oracle's gradients taken sequence by sequence, with rows
past the last sequence and sequences without keys or rows; ALiBi and the softcap through the
packed passes; learned sinks' gradient; key counts (seqused_k); what packed calls with grad refuse; opcheck and torch.compile; marked gpu, the
same on an NVIDIA GPU."""

import pytest
import torch
from cases import GRAD_TOL
from test_backward import BUILT, PASS_NAMES, TORCH, ran  # noqa: F401 (ran: a fixture)

import rdnattention
from rdnattention import attention_gradients, flash_attn_varlen_func, ops, varlen_attn
from rdnattention.errors import UnsupportedError
from rdnattention.reference import _attention64

# (lengths_q, lengths_k, rows past the last sequence, options): sequences cut partway through
# row and key blocks, one without rows, one without keys (its rows see nothing: zero gradient).
CASES = {
    "causal_ragged": ([37, 0, 70, 9], [37, 5, 70, 9], 3, {"causal": True}),
    "cross_window": ([5, 40, 21], [50, 40, 0], 0, {"window_size": (9, 4)}),
    "gqa_plain": ([66, 1], [66, 80], 0, {}),
}


def _packed(lengths_q, lengths_k, extra, hq, hk, d, dtype, seed):
    """q, k, v, dout packed [total, heads, d] (``extra`` rows of q past the last sequence) and the
    int32 offsets."""
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lengths_q) + extra, sum(lengths_k)
    q, dout = (torch.randn(total_q, hq, d, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(total_k, hk, d, generator=g).to(dtype) for _ in range(2))
    cu = lambda n: torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    return q, k, v, dout, cu(lengths_q), cu(lengths_k)


def _view(t):  # [total, heads, d] -> [1, heads, total, d]
    return t.unsqueeze(0).transpose(1, 2)


def _oracle(q, k, v, dout, cu_q, cu_k, causal=False, window_size=(-1, -1), used=None, **options):
    """The float64 gradients, each sequence on its own rows and keys (its first ``used[b]`` keys
    where given); zero elsewhere."""
    grads = [torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v)]
    for b in range(len(cu_q) - 1):
        k1 = int(cu_k[b + 1]) if used is None else int(cu_k[b]) + used[b]
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), k1)
        if qs.stop == qs.start or ks.stop == ks.start:
            continue
        slopes = options.get("alibi_slopes")
        kw = dict(options, alibi_slopes=slopes[b] if slopes is not None and slopes.dim() == 2 else slopes)
        parts = attention_gradients(_view(q[qs]), _view(k[ks]), _view(v[ks]), _view(dout[qs]), is_causal=causal,
                                    window_size=window_size, **kw)
        for g, part, rows in zip(grads, parts, (qs, ks, ks)):
            g[rows] = part[0].transpose(0, 1)
    return grads


def _grads(q, k, v, dout, cu_q, cu_k, **options):
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    max_k = int((cu_k[1:] - cu_k[:-1]).max())
    out = flash_attn_varlen_func(*x, cu_q.to(q.device), cu_k.to(q.device), max_q, max_k, **options)
    out.backward(dout)
    return tuple(t.grad for t in x)


def _check(grads, refs, dtype):
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert g.dtype == dtype and g.shape == r.shape
        assert torch.isfinite(g).all(), name
        scale = max(r.abs().max().item(), 1e-3)
        err = (g.double().cpu() - r).abs().max().item()
        assert err <= GRAD_TOL[dtype] * scale, f"{name}: max abs error {err:.2e}, {err / scale:.2e} of its largest"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("target,head_dim,dtype", BUILT, ids=["-".join(map(str, p)) for p in BUILT])
def test_packed_gradients_match_oracle(host_build, monkeypatch, ran, target, head_dim, dtype, case, deterministic):
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    lengths_q, lengths_k, extra, options = CASES[case]
    q, k, v, dout, cu_q, cu_k = _packed(lengths_q, lengths_k, extra, 4, 2, head_dim, TORCH[dtype], head_dim)
    grads = _grads(q, k, v, dout, cu_q, cu_k, deterministic=deterministic, **options)
    refs = _oracle(q, k, v, dout, cu_q, cu_k, **options)
    _check(grads, refs, TORCH[dtype])
    # Rows of no sequence, and sequences without keys: exactly zero (nothing of theirs is read).
    assert not grads[0][sum(lengths_q):].any()
    assert len(ran) == 1 and [n.split("_")[1] for n in ran[0]] == PASS_NAMES[deterministic]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_packed_alibi_and_softcap(host_build, deterministic):
    """ALiBi slopes per sequence and head, a softcap and a causal mask through the packed passes."""
    lengths_q, lengths_k = [20, 45, 3], [31, 45, 17]
    q, k, v, dout, cu_q, cu_k = _packed(lengths_q, lengths_k, 2, 4, 2, 64, torch.float16, 7)
    slopes = torch.rand(3, 4, generator=torch.Generator().manual_seed(3)) * 0.5
    options = dict(causal=True, softcap=4.0, alibi_slopes=slopes)
    grads = _grads(q, k, v, dout, cu_q, cu_k, deterministic=deterministic, **options)
    _check(grads, _oracle(q, k, v, dout, cu_q, cu_k, **options), torch.float16)


def _packed_sinks_case(device: str, case: str, deterministic: bool, sinks_only: bool, monkeypatch=None) -> None:
    """Learned sinks through the packed backward on ``device``, against the float64 oracle."""
    lengths_q, lengths_k, extra, options = CASES[case]
    q, k, v, dout, cu_q, cu_k = _packed(lengths_q, lengths_k, extra, 4, 2, 64, torch.float16, 91)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5)) + 0.5
    x = [t.detach().to(device).requires_grad_(not sinks_only) for t in (q, k, v)]
    x.append(sinks.to(device).requires_grad_())
    out = flash_attn_varlen_func(*x[:3], cu_q.to(device), cu_k.to(device), max(lengths_q), max(lengths_k),
                                 sinks=x[3], deterministic=deterministic, **options)
    if sinks_only:  # q, k and v need no gradient: no backward pass runs
        def no_pass(*args, **kwargs):
            raise AssertionError("a backward pass ran for gradients nobody asked for")

        monkeypatch.setattr(ops, "flash_attn_varlen_bwd", no_pass)
    out.backward(dout.to(device))
    # The oracle: each sequence's float64 attention with the sinks, differentiated.
    leaves = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v, sinks)]
    with torch.enable_grad():
        loss = 0.0
        for b in range(len(lengths_q)):
            qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            if qs.stop == qs.start or ks.stop == ks.start:  # no rows, or rows of zero output: nothing
                continue
            o = _attention64(_view(leaves[0][qs]), _view(leaves[1][ks]), _view(leaves[2][ks]), sinks=leaves[3],
                             is_causal=options.get("causal", False), window_size=options.get("window_size", (-1, -1)))
            loss = loss + (o[0].transpose(0, 1) * dout[qs].double()).sum()
        refs = torch.autograd.grad(loss, leaves)
    assert x[3].grad.dtype == torch.float32 and x[3].grad.shape == sinks.shape
    err = (x[3].grad.double().cpu() - refs[3]).abs().max().item()
    assert err <= GRAD_TOL[torch.float16] * max(refs[3].abs().max().item(), 1.0)
    if sinks_only:
        assert all(t.grad is None for t in x[:3])
    else:
        _check(tuple(t.grad for t in x[:3]), refs[:3], torch.float16)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("sinks_only", [False, True], ids=["with_qkv", "sinks_only"])
@pytest.mark.parametrize("case", ["causal_ragged", "cross_window"])
def test_packed_sinks_get_their_gradient(host_build, monkeypatch, case, deterministic, sinks_only):
    """Learned attention sinks (gpt-oss's) through the packed backward: the sinks' gradient, and q,
    k and v's, against the float64 oracle's taken sequence by sequence; rows past the last
    sequence (causal_ragged: their log-sum-exp never written) count nothing; the rows of a sequence
    without keys (cross_window) are all sink, of zero output and zero gradient."""
    _packed_sinks_case("cpu", case, deterministic, sinks_only, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", ["causal_ragged", "cross_window"])
def test_cuda_packed_sinks_get_their_gradient(case, deterministic):
    if not torch.cuda.is_available() or torch.version.hip is not None:
        pytest.skip("needs an NVIDIA GPU")
    _packed_sinks_case("cuda", case, deterministic, sinks_only=False)


def test_varlen_attn_and_packed_forms_take_grad(host_build):
    """torch's varlen_attn (window (-1, 0): causal) and flash-attn's qkv-packed form record the
    same backward as flash_attn_varlen_func."""
    lengths = [30, 12, 41]
    q, k, v, dout, cu, _ = _packed(lengths, lengths, 0, 2, 2, 64, torch.float16, 11)
    refs = _oracle(q, k, v, dout, cu, cu, causal=True)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    varlen_attn(*x, cu, cu, 41, 41, window_size=(-1, 0)).backward(dout)
    _check(tuple(t.grad for t in x), refs, torch.float16)
    qkv = torch.stack((q, k, v), dim=1).requires_grad_()
    rdnattention.flash_attn_varlen_qkvpacked_func(qkv, cu, 41, causal=True).backward(dout)
    _check(qkv.grad.unbind(1), refs, torch.float16)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_gradients_with_seqused_k_are_each_sequences_on_its_used_keys(host_build, ran, causal, deterministic):
    """varlen_attn with seqused_k and grad: each sequence attends to its first seqused_k[b] keys
    (the queries aligned to the end of them), its gradients the oracle's on those keys, the
    sequence's other keys zero gradients; the packed passes run, given the counts."""
    lengths_q, lengths_k, used = [12, 30, 7], [40, 30, 25], (17, 30, 0)
    q, k, v, dout, cu_q, cu_k = _packed(lengths_q, lengths_k, 0, 4, 2, 64, torch.float16, 23)
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)  # (varlen_attn has no deterministic argument)
    try:
        out = varlen_attn(*x, cu_q, cu_k, 30, 40, seqused_k=torch.tensor(used, dtype=torch.int32),
                          window_size=(-1, 0) if causal else (-1, -1), enable_gqa=True)
        out.backward(dout)
    finally:
        torch.use_deterministic_algorithms(before)
    _check(tuple(t.grad for t in x), _oracle(q, k, v, dout, cu_q, cu_k, causal=causal, used=used), torch.float16)
    assert len(ran) == 1 and [n.split("_")[1] for n in ran[0]] == PASS_NAMES[deterministic]


def test_packed_calls_with_grad_refuse_what_the_backward_does_not_take(host_build):
    q, k, v, _, cu_q, cu_k = _packed([10, 6], [10, 6], 0, 2, 2, 64, torch.float16, 13)
    before = [t.clone() for t in (q, k, v)]
    q.requires_grad_()
    pool = k.view(2, 8, 2, 64)
    with pytest.raises(UnsupportedError, match="does not take block_table"):
        flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 10, 16,
                               block_table=torch.tensor([[0], [1]], dtype=torch.int32))
    with pytest.raises(UnsupportedError, match="sinks requires grad, and the backward pass of packed sequences does "
                                               "not take block_table"):
        varlen_attn(q.detach(), pool, pool, cu_q, None, 10, 16, seqused_k=torch.tensor([5, 6], dtype=torch.int32),
                    block_table=torch.tensor([[0], [1]], dtype=torch.int32), sinks=torch.zeros(2, requires_grad=True))
    assert q.grad is None and all(torch.equal(a, b) for a, b in zip((q, k, v), before))


def test_packed_backward_opcheck_and_compile(host_build):
    # No row past the last sequence: its log-sum-exp is left unwritten (as flash-attn's), which opcheck
    # would compare between runs.
    q, k, v, dout, cu_q, cu_k = _packed([17, 30], [25, 30], 0, 4, 2, 64, torch.float16, 17)
    out, lse = torch.ops.rdnattention.flash_attn_decode_fwd(q, k, v, None, None, None, cu_q, cu_k, 2, 30, 30, -1, 0,
                                                            0.125, True, 0)
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_varlen_bwd.default,
                          (dout, q, k, v, out, lse, None, cu_q, cu_k, 30, 30, -1, 0, 0.125, 0.0, True))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_decode_fwd.default,
                          (qg, kg, vg, None, None, None, cu_q, cu_k, 2, 30, 30, -1, 0, 0.125, True, 0))
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1))
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_decode_fwd.default,  # learned sinks alone
                          (q, k, v, None, None, None, cu_q, cu_k, 2, 30, 30, -1, 0, 0.125, True, 0, 0.0, None,
                           sinks.clone().requires_grad_()))

    def layer(q, k, v, sinks):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, causal=True, deterministic=True, sinks=sinks)

    def grads(fn):
        x = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        fn(*x).backward(dout)
        return [t.grad for t in x]

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert all(torch.equal(a, b) for a, b in zip(grads(compiled), grads(layer)))


def test_direct_decode_op_call_with_a_cache_has_no_backward(host_build):
    q = torch.randn(1, 1, 2, 64, dtype=torch.float16, requires_grad=True)
    cache = torch.randn(1, 16, 2, 64, dtype=torch.float16)
    out, _ = torch.ops.rdnattention.flash_attn_decode_fwd(q, cache, cache, torch.tensor([9], dtype=torch.int32),
                                                          None, None, None, None, 1, 1, 16, -1, -1, 0.125, True, 0)
    with pytest.raises(UnsupportedError, match="packed sequences alone, not with cu_seqlens_q=None"):
        out.backward(torch.ones_like(out))


# --- on an NVIDIA GPU (sm_90's kernels)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_cuda_packed_gradients_match_oracle(case, head_dim, dtype, deterministic):
    if not torch.cuda.is_available() or torch.version.hip is not None:
        pytest.skip("needs an NVIDIA GPU")
    lengths_q, lengths_k, extra, options = CASES[case]
    tensors = _packed(lengths_q, lengths_k, extra, 4, 2, head_dim, TORCH[dtype], head_dim)
    q, k, v, dout, cu_q, cu_k = (t.cuda() for t in tensors)
    grads = _grads(q, k, v, dout, cu_q, cu_k, deterministic=deterministic, **options)
    _check(grads, _oracle(*(t.cpu() for t in (q, k, v, dout, cu_q, cu_k)), **options), TORCH[dtype])
    assert not grads[0][sum(lengths_q):].any()
