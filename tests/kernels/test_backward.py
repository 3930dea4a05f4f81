"""The backward pass (the bwd family, autograd through rdnattention::flash_attn_fwd): every backward
kernel the host targets build, fp16 and bf16, against the float64 oracle's gradients
(attention_gradients) on causal, windowed, GQA, cross-length and softcapped calls; a
finite-difference check of the same gradients; determinism; RoPE, applied by torch operations
before the kernels; torch.compile and opcheck; and, marked gpu, the
same on an NVIDIA GPU against the oracle and against torch's math backward."""

import pytest
import torch
import torch.nn.functional as F
from cases import GRAD_TOL, HOST_TARGETS, UNIT, mirrored_kernels

import rdnattention
from rdnattention import (attention_gradients, attention_reference, flash_attn, flash_attn_func,
                          flash_attn_qkvpacked_func, rotary_tables)
from rdnattention import ops, route
from rdnattention.errors import UnsupportedError
from rdnattention.families import bwd
from rdnattention.reference import _attention64
from rdnattention_gen.families import spec_from_name
from rdnattention_gen.matrix import load_matrix

DTYPE_NAMES = {None: torch.float16, "bf16": torch.bfloat16}


def _built(targets=HOST_TARGETS):
    """(target, head_dim, dtype) of every backward kernel set ``targets`` build (their own tiles; the
    host targets' alternates: test_alternate_tiles_match_oracle)."""
    m = load_matrix()
    return sorted({(t, v.spec.head_dim, v.spec.option("dtype") or "fp16") for t in targets
                   for v in m.variants_for(m.target(t)) if v.spec.family == bwd.NAME and v.priority >= 0})


BUILT = _built()
CUDA_BUILT = [(head_dim, dtype) for _, head_dim, dtype in _built(("sm_90",))]
TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16}

# (batch, heads_q, heads_kv, seq_q, seq_k, options): each cuts row and key blocks partway.
CASES = {
    "plain": (2, 2, 2, 37, 37, {}),
    "causal_gqa": (1, 4, 2, 45, 45, {"is_causal": True}),
    "mqa_cross": (1, 3, 1, 21, 50, {"is_causal": True}),          # more keys than queries, end-aligned
    "window_two_sided": (1, 2, 2, 40, 40, {"window_size": (9, 4)}),
    "few_keys": (1, 2, 1, 40, 19, {"is_causal": True}),            # rows that see no key
    "softcap_window": (1, 4, 2, 33, 33, {"is_causal": True, "window_size": (12, -1), "softcap": 2.0}),
    "few_rows": (2, 2, 2, 5, 70, {"is_causal": True}),               # a forward of the split-KV kernels
    # ALiBi: slopes per head, and per batch and head with a window and a softcap (bloom's and
    # flash-attn's semantics: the bias -slope |key - diag| after the cap)
    "alibi_causal_gqa": (1, 4, 2, 39, 47, {"is_causal": True, "alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}),
    "alibi_batch_window_softcap": (2, 2, 2, 36, 36, {"window_size": (11, 5), "softcap": 3.0,
                                                     "alibi_slopes": torch.tensor([[0.3, 0.05], [0.7, 0.2]])}),
}


def _inputs(b, hq, hk, sq, sk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, sq, d, generator=g).to(dtype), torch.randn(b, hk, sk, d, generator=g).to(dtype),
            torch.randn(b, hk, sk, d, generator=g).to(dtype), torch.randn(b, hq, sq, d, generator=g).to(dtype))


def _grads(q, k, v, dout, **options):
    """Our gradients of flash_attn's output against ``dout`` (``deterministic`` among the options)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    flash_attn(q, k, v, **options).backward(dout)
    return q.grad, k.grad, v.grad


# The passes each backward mode runs, by the kernels' name prefixes.
PASS_NAMES = {False: ["bwdpre", "bwdatomic", "bwddqcast"], True: ["bwdpre", "bwd", "bwddq"]}


def _check(grads, refs, dtype):
    for name, g, r in zip(("dq", "dk", "dv"), grads, refs):
        assert g.dtype == dtype and g.shape == r.shape
        assert torch.isfinite(g).all(), name
        scale = r.abs().max().item()
        err = (g.double().cpu() - r).abs().max().item()
        assert err <= GRAD_TOL[dtype] * scale, f"{name}: max abs error {err:.2e}, {err / scale:.2e} of its largest"


@pytest.fixture
def ran(monkeypatch):
    """The kernel names each backward call planned."""
    names = []
    plan = bwd.plan

    def recording(table, **kw):
        p = plan(table, **kw)
        names.append([launch.kernel.name for launch in p.launches])
        return p

    monkeypatch.setattr(bwd, "plan", recording)
    return names


def _forward_served(q, k, v, options) -> bool:
    """Whether the forward kernels of q's device serve the call: a softcap or ALiBi runs kernels of a
    score option or the split-KV kernels, which some targets build at fewer head_dims than the
    backward's (then the call is refused, with grad or without)."""
    try:
        with torch.no_grad():
            flash_attn(q, k, v, **options)
    except UnsupportedError:
        return False
    return True


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("target,head_dim,dtype", BUILT, ids=["-".join(map(str, p)) for p in BUILT])
def test_gradients_match_oracle(host_build, monkeypatch, ran, target, head_dim, dtype, case, deterministic):
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    b, hq, hk, sq, sk, options = CASES[case]
    q, k, v, dout = _inputs(b, hq, hk, sq, sk, head_dim, TORCH[dtype], head_dim + list(CASES).index(case))
    if not _forward_served(q, k, v, options):  # the backward alone: test_alternate_tiles_match_oracle
        with pytest.raises(UnsupportedError):
            _grads(q, k, v, dout, deterministic=deterministic, **options)
        return
    grads = _grads(q, k, v, dout, deterministic=deterministic, **options)
    _check(grads, attention_gradients(q, k, v, dout, **options), TORCH[dtype])
    # The three passes of this head_dim, dtype and mode ran (the host takes the atomic ones by default).
    assert len(ran) == 1 and [n.split("_")[1] for n in ran[0]] == PASS_NAMES[deterministic]
    assert all(f"_hd{head_dim}_" in n and (("_bf16_" in n) == (dtype == "bf16")) for n in ran[0])


def _alternates():
    """(host target, head_dim, dtype, (pre, dK/dV, dQ kernel names)) of the backward tiles the host
    targets build as alternates (mirrors of the GPU targets' tables), run only by name."""
    groups = {}
    for target, name in mirrored_kernels((bwd.NAME,)):
        spec = spec_from_name(name)
        key = (target, spec.head_dim, spec.option("dtype") or "fp16", spec.tile)
        groups.setdefault(key, {})[spec.option("layout")] = name
    return [(t, hd, dt, (g["pre"], g[None], g["dq"]), (g["pre"], g["atomic"], g["dqcast"]))
            for (t, hd, dt, _), g in sorted(groups.items())]


ALTERNATES = _alternates()


@pytest.mark.parametrize("target,head_dim,dtype,kernels,atomic_kernels", ALTERNATES,
                         ids=[a[3][1] for a in ALTERNATES])
def test_alternate_tiles_match_oracle(host_build, monkeypatch, target, head_dim, dtype, kernels, atomic_kernels):
    """Each mirrored tile, forced by name (its deterministic passes and its atomic ones), on a causal
    GQA call, a softcapped window and ALiBi."""
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    for case in ("causal_gqa", "softcap_window", "alibi_batch_window_softcap"):
        b, hq, hk, sq, sk, options = CASES[case]
        q, k, v, dout = _inputs(b, hq, hk, sq, sk, head_dim, TORCH[dtype], head_dim)
        if _forward_served(q, k, v, options):
            out, lse = flash_attn(q, k, v, return_lse=True, **options)
        else:  # the oracle's forward, rounded as ours stores it
            out, lse = attention_reference(q, k, v, return_lse=True, **options)
            out, lse = out.to(q.dtype), lse.float()
        left, right = options.get("window_size", (-1, -1))
        window = (left, (0 if right < 0 else min(right, 0)) if options.get("is_causal") else right)
        refs = attention_gradients(q, k, v, dout, **options)
        for names, atomic in ((kernels, False), (atomic_kernels, True)):
            grads = ops.backward(dout, q, k, v, out, lse, None, *window, head_dim ** -0.5,
                                 options.get("softcap", 0.0), kernels=names, atomic=atomic,
                                 alibi_slopes=options.get("alibi_slopes"))
            _check(grads, refs, TORCH[dtype])


def test_gradient_of_the_log_sum_exp(host_build):
    """A loss that uses the LSE too: its gradient joins delta (dS = P (dP - delta + dLSE)); then
    plain sums of both, whose gradients autograd passes expanded."""
    q, k, v, dout = _inputs(1, 4, 2, 30, 41, 64, torch.float16, 5)
    dlse = torch.randn(1, 4, 30, generator=torch.Generator().manual_seed(6))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attn(qg, kg, vg, is_causal=True, return_lse=True)
    torch.autograd.backward((out, lse), (dout, dlse))
    _check((qg.grad, kg.grad, vg.grad), attention_gradients(q, k, v, dout, dlse=dlse, is_causal=True), torch.float16)
    # Sums of both: gradients of ones, expanded (zero strides), read as the rows they stand for.
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = flash_attn(qg, kg, vg, is_causal=True, return_lse=True)
    (out.float().sum() + lse.sum()).backward()
    ones = torch.ones_like(dout), torch.ones_like(dlse)
    _check((qg.grad, kg.grad, vg.grad), attention_gradients(q, k, v, ones[0], dlse=ones[1], is_causal=True),
           torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_directional_derivatives_match_finite_differences(host_build, dtype):
    """gradcheck's test, on our gradients: <grad, d> against the central difference of the float64
    oracle's loss sum(out * dO) along a random direction d, per input, on a small shape."""
    q, k, v, dout = _inputs(1, 4, 2, 19, 23, 64, dtype, 11)
    options = {"is_causal": True, "window_size": (10, -1), "softcap": 3.0}
    grads = _grads(q, k, v, dout, **options)
    x64 = [t.double() for t in (q, k, v)]
    g = torch.Generator().manual_seed(12)
    eps = 1e-4
    for i, grad in enumerate(grads):
        d = torch.randn(x64[i].shape, generator=g, dtype=torch.float64)

        def loss(step):
            x = list(x64)
            x[i] = x[i] + step * d
            return (_attention64(*x, **options) * dout.double()).sum().item()
        numeric = (loss(eps) - loss(-eps)) / (2 * eps)
        analytic = (grad.double() * d).sum().item()
        # Each element within GRAD_TOL of the largest gradient element (test_gradients_match_oracle).
        ref = attention_gradients(q, k, v, dout, **options)[i]
        assert abs(analytic - numeric) <= GRAD_TOL[dtype] * ref.abs().max().item() * d.abs().sum().item()


def test_the_oracle_passes_gradcheck():
    """The oracle's gradients (autograd through its float64 computation, masks and softcap included)
    against torch.autograd.gradcheck's finite differences."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for h, s in ((4, 7), (2, 9), (2, 9)))
    for options in ({"is_causal": True}, {"window_size": (3, 1), "softcap": 1.5}):
        assert torch.autograd.gradcheck(lambda q, k, v: _attention64(q, k, v, **options), (q, k, v))


@pytest.mark.parametrize("how", ["argument", "torch"])
def test_backward_is_deterministic(host_build, ran, how):
    """deterministic=True (or torch.use_deterministic_algorithms): bitwise the same gradients run to
    run and with the emulator's threads in another order at every barrier (no atomics; a missing
    barrier would show)."""
    q, k, v, dout = _inputs(1, 4, 2, 70, 70, 64, torch.float16, 21)
    options = {"is_causal": True, **({"deterministic": True} if how == "argument" else {})}
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(how == "torch" or before)
    try:
        first = _grads(q, k, v, dout, **options)
        assert all(torch.equal(a, b) for a, b in zip(first, _grads(q, k, v, dout, **options)))
        rdnattention.set_host_shuffle(7)
        try:
            shuffled = _grads(q, k, v, dout, **options)
        finally:
            rdnattention.set_host_shuffle(None)
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(a, b) for a, b in zip(first, shuffled))
    assert all([n.split("_")[1] for n in names] == PASS_NAMES[True] for names in ran)


def test_atomic_backward_changes_only_dq_summation_order(host_build, ran):
    """The atomic passes (the host's default) give dK and dV bitwise the deterministic passes' (the
    same sums in the same order), and a dQ within the oracle's tolerance of theirs: only the order
    in which the key blocks' shares of a dQ row are added differs."""
    q, k, v, dout = _inputs(2, 4, 2, 150, 150, 64, torch.float16, 22)
    atomic = _grads(q, k, v, dout, is_causal=True)
    fixed = _grads(q, k, v, dout, is_causal=True, deterministic=True)
    assert [[n.split("_")[1] for n in names] for names in ran] == [PASS_NAMES[False], PASS_NAMES[True]]
    assert torch.equal(atomic[1], fixed[1]) and torch.equal(atomic[2], fixed[2])
    _check(atomic, attention_gradients(q, k, v, dout, is_causal=True), torch.float16)
    # dQ is the scaled fp32 sum, rounded once: at most an fp16 unit or two from the fixed order's.
    assert (atomic[0].float() - fixed[0].float()).abs().max() <= 2 * UNIT[torch.float16] * fixed[0].abs().max()


def test_the_atomic_passes_are_taken_where_timed(monkeypatch):
    """ops.atomic_backward: not on AMD targets (never timed there), nor where deterministic is asked."""
    class Table:
        def __init__(self, platform):
            self.platform = platform

    monkeypatch.setattr(bwd, "served", lambda table, head_dim, dtype, passes=bwd.DETERMINISTIC: True)
    q = torch.empty(1, 1, 1, 64, dtype=torch.float16)
    assert ops.atomic_backward(Table("cuda"), q, False) and ops.atomic_backward(Table("host"), q, False)
    assert not ops.atomic_backward(Table("amdgcn"), q, False)
    assert not ops.atomic_backward(Table("cuda"), q, True)
    monkeypatch.setattr(bwd, "served", lambda table, head_dim, dtype, passes=bwd.DETERMINISTIC:
                        passes == bwd.DETERMINISTIC)
    assert not ops.atomic_backward(Table("cuda"), q, False)  # kernels built without the atomic passes


def test_flash_attn_func_and_packed_entries_take_grad(host_build):
    """The token-major entry points: gradients in the inputs' layout, the packed one's into its
    packed tensor, equal to flash_attn's (bit for bit: each with deterministic=True, flash-attn's
    flag, which they pass on)."""
    q, k, v, dout = _inputs(1, 2, 2, 30, 30, 64, torch.float16, 31)
    want = _grads(q, k, v, dout, is_causal=True, deterministic=True)
    qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    flash_attn_func(qt, kt, vt, causal=True, deterministic=True).backward(dout.transpose(1, 2))
    for g, w in zip((qt.grad, kt.grad, vt.grad), want):
        assert torch.equal(g.transpose(1, 2), w)
    qkv = torch.stack([t.transpose(1, 2) for t in (q, k, v)], dim=2).requires_grad_()  # [b, s, 3, h, d]
    flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True).backward(dout.transpose(1, 2))
    for i, w in enumerate(want):
        assert torch.equal(qkv.grad[:, :, i].transpose(1, 2), w)


def test_head_dim_padded_by_flash_attn_func_takes_grad(host_build):
    """flash_attn_func pads a head_dim that is not a multiple of 8 (60 -> 64): the gradient flows
    back through the padding to the inputs' 60 columns."""
    q, k, v, dout = _inputs(1, 2, 2, 20, 20, 60, torch.float16, 41)
    qt, kt, vt = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    flash_attn_func(qt, kt, vt, causal=True).backward(dout.transpose(1, 2))
    _check(tuple(t.grad.transpose(1, 2) for t in (qt, kt, vt)), attention_gradients(q, k, v, dout, is_causal=True),
           torch.float16)


# (batch, heads_q, heads_kv, seq_q, seq_k, keys each sequence uses, options): a cache longer than its
# keys, one sequence of none, queries aligned to the end of each sequence's keys.
SEQUSED = {
    "causal_gqa": (3, 4, 2, 20, 70, (70, 33, 0), {"is_causal": True}),
    "window_softcap_alibi": (2, 2, 2, 24, 60, (17, 60), {"window_size": (9, 4), "softcap": 2.0,
                                                          "alibi_slopes": torch.tensor([0.5, 0.125])}),
}


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", SEQUSED)
@pytest.mark.parametrize("target,dtype", [(t, d) for t in HOST_TARGETS for d in ("fp16", "bf16")])
def test_seqused_k_gradients_match_oracle(host_build, monkeypatch, ran, target, dtype, case, deterministic):
    """Per-sequence key counts (seqused_k) with grad: each sequence's gradients are the oracle's on
    its own keys, the keys past them get zero gradients, and the passes run the kernels."""
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    b, hq, hk, sq, sk, used, options = SEQUSED[case]
    q, k, v, dout = _inputs(b, hq, hk, sq, sk, 64, TORCH[dtype], 91 + len(case))
    seqused = torch.tensor(used, dtype=torch.int32)
    grads = _grads(q, k, v, dout, deterministic=deterministic, seqused_k=seqused, **options)
    assert len(ran) == 1 and [n.split("_")[1] for n in ran[0]] == PASS_NAMES[deterministic]
    for i, n in enumerate(used):
        mine = (grads[0][i:i + 1], grads[1][i:i + 1, :, :n], grads[2][i:i + 1, :, :n])
        assert not grads[1][i, :, n:].any() and not grads[2][i, :, n:].any()
        if n == 0:  # no key: nothing depends on anything
            assert not grads[0][i].any()
            continue
        _check(mine, attention_gradients(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], dout[i:i + 1], **options),
               TORCH[dtype])


# (batch, heads_q, heads_kv, seq_q, seq_k, rotary_dim, interleaved, options)
ROTARY = {
    "causal_gqa_halves": (2, 4, 2, 37, 37, 64, False, {"is_causal": True}),
    "cross_interleaved_partial": (1, 2, 1, 21, 50, 32, True, {"is_causal": True}),
    "window_softcap": (1, 2, 2, 40, 40, 48, False, {"window_size": (9, 4), "softcap": 3.0}),
}


@pytest.mark.parametrize("case", ROTARY)
def test_rope_with_gradients_matches_the_oracle(host_build, ran, caplog, case):
    """RoPE (rotary_cos/rotary_sin) in a call that requires grad: q and k rotated by torch
    operations before the kernels, whose backward takes no rotation; the gradients reach the
    unrotated inputs as the float64 oracle's (which rotates in float64), the forward runs the
    kernels without RoPE, and the calls are counted, the first logged."""
    b, hq, hk, sq, sk, rotary_dim, interleaved, options = ROTARY[case]
    q, k, v, dout = _inputs(b, hq, hk, sq, sk, 64, torch.float16, 51 + sq)
    cos, sin = rotary_tables(sk, rotary_dim)
    rope = {"rotary_cos": cos, "rotary_sin": sin, "rotary_interleaved": interleaved}
    rdnattention.stats(reset=True)
    with caplog.at_level("WARNING", logger="rdnattention"):
        grads = _grads(q, k, v, dout, **rope, **options)
        assert torch.equal(_grads(q, k, v, dout, deterministic=True, **rope, **options)[2], grads[2])
    assert len(ran) == 2
    _check(grads, attention_gradients(q, k, v, dout, **rope, **options), torch.float16)
    assert rdnattention.stats()["backward"]["rotary"] == 2
    assert sum("RoPE in a call that requires grad" in r.getMessage() for r in caplog.records) == 1
    with torch.no_grad():  # forward only: RoPE in the kernels, the same output to fp16 rounding
        torch.testing.assert_close(flash_attn(q, k, v, **rope, **options), _forward(q, k, v, **rope, **options),
                                   atol=2e-3, rtol=2e-3)


def test_rope_with_gradients_and_seqused_k_rotates_each_sequence_at_its_own_positions(host_build):
    """With seqused_k, each sequence's queries sit at the end of its own keys: their rotation, and
    so their gradients, are the oracle's on that sequence's keys alone."""
    used = (30, 12)
    q, k, v, dout = _inputs(2, 2, 2, 8, 30, 64, torch.float16, 77)
    cos, sin = rotary_tables(30, 64)
    rope = {"rotary_cos": cos, "rotary_sin": sin, "is_causal": True}
    grads = _grads(q, k, v, dout, seqused_k=torch.tensor(used, dtype=torch.int32), **rope)
    for i, n in enumerate(used):
        _check((grads[0][i:i + 1], grads[1][i:i + 1, :, :n], grads[2][i:i + 1, :, :n]),
               attention_gradients(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], dout[i:i + 1], **rope),
               torch.float16)


def _forward(q, k, v, **options):
    """The forward of a call whose inputs require grad (the path the gradients take), detached."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        return flash_attn(q, k, v, **options).detach()


def _sink_oracle(q, k, v, dout, sinks, **options):
    """The float64 gradients (dq, dk, dv, dsinks) through the oracle's forward with sinks."""
    leaves = [t.detach().to(torch.float64).requires_grad_() for t in (q, k, v, sinks)]
    with torch.enable_grad():
        out = _attention64(*leaves[:3], sinks=leaves[3], **options)
        return torch.autograd.grad((out * dout.double()).sum(), leaves)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("case", ["causal_gqa", "window_two_sided", "few_keys"])
def test_sinks_get_gradients_with_q_k_v(host_build, case, deterministic):
    """Attention sinks (gpt-oss's learned logits): q, k and v's gradients from the same kernels
    (the log-sum-exp holds the sink), and the sinks' own, against the float64 oracle's; rows that
    see no key (few_keys) are all sink."""
    b, hq, hk, sq, sk, options = CASES[case]
    q, k, v, dout = _inputs(b, hq, hk, sq, sk, 64, torch.float16, 81)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(3)) + 1.0
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    flash_attn(*leaves[:3], sinks=leaves[3], deterministic=deterministic, **options).backward(dout)
    refs = _sink_oracle(q, k, v, dout, sinks, **options)
    _check(tuple(t.grad for t in leaves[:3]), refs[:3], torch.float16)
    assert leaves[3].grad.dtype == torch.float32 and leaves[3].grad.shape == sinks.shape
    # dsinks is a sum over rows of fp32 products of the stored fp16 output: the output's rounding
    err = (leaves[3].grad.double() - refs[3]).abs().max().item()
    assert err <= GRAD_TOL[torch.float16] * max(refs[3].abs().max().item(), 1.0)


def test_sinks_alone_may_require_grad(host_build, monkeypatch):
    """Frozen q, k and v with learned sinks: autograd records the call (no silent loss of the
    gradient), the sinks' gradient is the oracle's, and no backward pass runs (q, k and v need
    none); a no_grad call is served as before."""
    b, hq, hk, sq, sk, options = CASES["causal_gqa"]
    q, k, v, dout = _inputs(b, hq, hk, sq, sk, 64, torch.float16, 82)
    sinks = torch.randn(hq).requires_grad_()
    out = flash_attn(q, k, v, sinks=sinks, **options)
    assert out.requires_grad

    def no_pass(*args, **kwargs):
        raise AssertionError("a backward pass ran for gradients nobody asked for")

    monkeypatch.setattr(rdnattention.ops, "flash_attn_bwd", no_pass)
    out.backward(dout)
    ref = _sink_oracle(q, k, v, dout, sinks, **options)[3]
    assert (sinks.grad.double() - ref).abs().max().item() <= GRAD_TOL[torch.float16] * max(ref.abs().max().item(), 1.0)
    with torch.no_grad():
        assert not flash_attn(q, k, v, sinks=sinks, **options).requires_grad


def test_a_call_without_keys_has_its_sinks_as_log_sum_exp(host_build):
    """No key at all (seq_k 0: nothing is launched): each row's log-sum-exp is its head's sink, as
    where the kernels find no key and as the oracle has it, not -inf; through that LSE the sinks'
    gradient is the LSE's (d lse / d sink = 1), not the NaN that exp(sink - -inf) made of it."""
    q = torch.randn(2, 4, 3, 64, dtype=torch.float16)
    k = v = torch.zeros(2, 2, 0, 64, dtype=torch.float16)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    for grad in (False, True):
        leaf = sinks.clone().requires_grad_(grad)
        out, lse = flash_attn(q, k, v, sinks=leaf, return_lse=True)
        ref, ref_lse = attention_reference(q, k, v, sinks=sinks, return_lse=True)
        assert not out.any() and torch.equal(lse.double(), ref_lse)
        if grad:
            weights = torch.randn(lse.shape)
            (lse * weights).sum().backward()
            assert torch.allclose(leaf.grad, weights.sum((0, 2)))


def test_entries_without_a_backward_refuse_sinks_that_require_grad(host_build):
    """The cache and packed entries give sinks no gradient: a sinks tensor that requires grad is
    refused there (never a silently missing gradient)."""
    q = torch.randn(1, 1, 4, 64, dtype=torch.float16)
    cache = torch.randn(1, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(UnsupportedError, match="sinks requires grad"):
        rdnattention.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([10], dtype=torch.int32),
                                             sinks=torch.zeros(4, requires_grad=True))


def test_entries_without_a_backward_are_refused(host_build):
    """Planning (a plan's run records nothing for autograd) and int8 (quantized inputs)."""
    q, k, v, _ = _inputs(1, 2, 2, 20, 20, 64, torch.float16, 65)
    q.requires_grad_()
    with pytest.raises(UnsupportedError, match="a plan runs the forward only"):
        rdnattention.plan_flash_attn(q, k, v)
    with pytest.raises(UnsupportedError, match="int8 attention has no backward pass"):
        rdnattention.flash_attn_int8qk_quantized(q, k, v)


def test_a_head_dim_above_every_backward_kernel_is_refused(host_build):
    q, k, v, _ = _inputs(1, 2, 2, 20, 20, 288, torch.float16, 61)  # the forward is built at 288
    with pytest.raises(UnsupportedError, match="no backward kernel for fp16 head_dim 288 or above"):
        flash_attn(q.requires_grad_(), k, v)


# (head_dim, dtype, the head_dim whose kernels run it): the next one built on the host (fp16 backward:
# 40, 64, 80, 96, 128, 160, 256), at head_dims whose forward the host builds (bf16's forward is built
# only where its backward is)
PADDED = [(8, "fp16", 40), (32, "fp16", 40), (200, "fp16", 256)]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("head_dim,dtype,padded", PADDED, ids=[f"{d}-{t}" for d, t, _ in PADDED])
def test_a_head_dim_without_backward_kernels_runs_the_next_ones_padded(host_build, ran, head_dim, dtype, padded,
                                                                       deterministic):
    """A head_dim with no backward kernels of its own runs those of the next one built for its dtype,
    on copies padded with zero columns: the gradients are the oracle's, every pass the padded
    head_dim's, and the call is counted (stats()["backward"]) and logged once."""
    rdnattention.stats(reset=True)
    for case in ("causal_gqa", "alibi_batch_window_softcap"):
        b, hq, hk, sq, sk, options = CASES[case]
        q, k, v, dout = _inputs(b, hq, hk, sq, sk, head_dim, TORCH[dtype], head_dim)
        if not _forward_served(q, k, v, options):
            continue
        grads = _grads(q, k, v, dout, deterministic=deterministic, **options)
        assert all(g.shape == t.shape and g.is_contiguous() for g, t in zip(grads, (q, k, v)))
        _check(grads, attention_gradients(q, k, v, dout, **options), TORCH[dtype])
        assert ran and all(f"_hd{padded}_" in name for name in ran[-1])
    counts = rdnattention.stats(reset=True)["backward"]
    assert counts["padded"] >= 1 and set(counts["head_dims"]) == {f"host {dtype} head_dim {head_dim} -> {padded}"}


def test_direct_op_call_without_lse_has_no_backward(host_build):
    q, k, v, dout = _inputs(1, 2, 2, 20, 20, 64, torch.float16, 71)
    q.requires_grad_()
    out, _ = torch.ops.rdnattention.flash_attn_fwd(q, k, v, None, None, -1, 0, 0.125, False, False, False)
    with pytest.raises(UnsupportedError, match="no backward with return_lse=False"):
        out.backward(dout)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_traces_forward_and_backward(host_build, backend):
    q, k, v, dout = _inputs(1, 4, 2, 30, 30, 64, torch.float16, 81)
    cos, sin = rotary_tables(30, 32)

    def layer(q, k, v):
        a = flash_attn(q, k, v, is_causal=True)
        b = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window_size=(8, 8))
        c = flash_attn(q, k, v, rotary_cos=cos, rotary_sin=sin)  # RoPE by torch operations, in the graph
        return a * 2 + b.transpose(1, 2) - c

    def grads(fn):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*x).backward(dout)
        return [t.grad for t in x]

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend=backend)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # the backward's passes read it when they run: bit for bit
    try:
        assert all(torch.equal(a, b) for a, b in zip(grads(compiled), grads(layer)))
    finally:
        torch.use_deterministic_algorithms(before)


def test_opcheck(host_build):
    q, k, v, dout = _inputs(1, 4, 2, 30, 40, 64, torch.float16, 91)
    out, lse = torch.ops.rdnattention.flash_attn_fwd(q, k, v, None, None, 10, 0, 0.125, False, True, False)
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_bwd.default,
                          (dout, q, k, v, out, lse, None, 10, 0, 0.125, 0.0))
    # flash_attn_func's token-major views at a head_dim whose gradients come from padded copies: laid
    # out as the inputs, as the fake says (they were contiguous: compiled code read them by the fake's strides)
    q8, k8, v8, dout8 = (t[..., :8].contiguous().transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout))
    out8, lse8 = torch.ops.rdnattention.flash_attn_fwd(q8, k8, v8, None, None, -1, -1, 0.125, False, True, False)
    grads = torch.ops.rdnattention.flash_attn_bwd(dout8, q8, k8, v8, out8, lse8, None, -1, -1, 0.125, 0.0)
    assert [g.stride() for g in grads] == [t.stride() for t in (q8, k8, v8)]
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_bwd.default,
                          (dout8, q8, k8, v8, out8, lse8, None, -1, -1, 0.125, 0.0), test_utils=("test_faketensor",))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    for token_major in (False, True):
        torch.library.opcheck(torch.ops.rdnattention.flash_attn_fwd.default,
                              (qg, kg, vg, None, None, -1, 0, 0.125, False, True, token_major))


# --- on an NVIDIA GPU (sm_90's kernels)

def _cuda():
    if not torch.cuda.is_available() or torch.version.hip is not None:
        pytest.skip("needs an NVIDIA GPU")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype", CUDA_BUILT, ids=[f"{d}-{t}" for d, t in CUDA_BUILT])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_cuda_gradients_match_oracle(case, head_dim, dtype, deterministic):
    device = _cuda()
    b, hq, hk, sq, sk, options = CASES[case]
    options = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in options.items()}
    q, k, v, dout = (t.to(device) for t in _inputs(b, hq, hk, sq, sk, head_dim, TORCH[dtype], head_dim))
    if not _forward_served(q, k, v, options):
        with pytest.raises(UnsupportedError):
            _grads(q, k, v, dout, deterministic=deterministic, **options)
        return
    _check(_grads(q, k, v, dout, deterministic=deterministic, **options), attention_gradients(q, k, v, dout, **options),
           TORCH[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cuda_sinks_get_gradients(dtype):
    """test_sinks_get_gradients_with_q_k_v on the GPU: q, k, v and the sinks against the oracle."""
    device = _cuda()
    b, hq, hk, sq, sk, options = CASES["causal_gqa"]
    q, k, v, dout = (t.to(device) for t in _inputs(b, hq, hk, sq, sk, 128, TORCH[dtype], 83))
    sinks = (torch.randn(hq, generator=torch.Generator().manual_seed(4)) + 1.0).to(device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    flash_attn(*leaves[:3], sinks=leaves[3], **options).backward(dout)
    refs = _sink_oracle(q.cpu(), k.cpu(), v.cpu(), dout.cpu(), sinks.cpu(), **options)
    _check(tuple(t.grad for t in leaves[:3]), refs[:3], TORCH[dtype])
    err = (leaves[3].grad.double().cpu() - refs[3]).abs().max().item()
    assert err <= GRAD_TOL[TORCH[dtype]] * max(refs[3].abs().max().item(), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cuda_gradients_match_torchs_math_backward(dtype):
    """Against torch's SDPA math backward in the inputs' dtype on the GPU, each measured by its
    error against the float64 oracle: ours no larger than the math path's (up to the stored
    gradient's rounding)."""
    device = _cuda()
    dt = TORCH[dtype]
    q, k, v, dout = (t.to(device) for t in _inputs(2, 8, 8, 300, 300, 128, dt, 101))
    ours = _grads(q, k, v, dout, is_causal=True)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        F.scaled_dot_product_attention(*x, is_causal=True).backward(dout)
    refs = attention_gradients(q, k, v, dout, is_causal=True)
    for g, m, r in zip(ours, (t.grad for t in x), refs):
        ours_err = (g.double().cpu() - r).abs().max().item()
        math_err = (m.double().cpu() - r).abs().max().item()
        assert ours_err <= math_err + UNIT[dt] * r.abs().max().item()
