"""Property-based tests of the backward pass on the host platform: random shapes, GQA ratios,
causal masks and windows, softcaps, ALiBi, per-sequence key counts, RoPE, head_dims with and
without backward kernels of their own, fp16 and bf16, atomic and deterministic passes; every
call's gradients against the float64 oracle's, and the inputs left as they were given."""


import torch
from cases import GRAD_TOL, TORCH_DTYPES, cancellation_floor, output_bound, property_examples, small_head_dims
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rdnattention import attention_gradients, attention_reference, flash_attn, rotary_tables
from rdnattention.errors import UnsupportedError

DTYPES = TORCH_DTYPES
# The forward's host head_dims up to 128 (the emulator runs every thread: keep cases quick); those
# without backward kernels run the next built head_dim's on padded copies (ops.backward_head_dim).
HEAD_DIMS = small_head_dims("f16")
# RDNATTENTION_PROPERTY_EXAMPLES raises the budget for a longer hunt outside the suite.
EXAMPLES = property_examples()


@st.composite
def calls(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    head_dim = draw(st.sampled_from(HEAD_DIMS[dtype]))
    heads_kv = draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.integers(1, 3))
    batch = draw(st.integers(1, 2))
    seq_q = draw(st.integers(1, 40))
    seq_k = draw(st.integers(1, 50))
    options = {"is_causal": draw(st.booleans()),
               "window_size": (draw(st.integers(-1, 30)), draw(st.integers(-1, 30))),
               "deterministic": draw(st.booleans())}
    if draw(st.booleans()):
        options["softcap"] = draw(st.floats(1.0, 30.0))
    if draw(st.booleans()):
        options["alibi_slopes"] = torch.tensor([draw(st.floats(0.0, 1.0)) for _ in range(heads_q)])
    used = tuple(draw(st.integers(0, seq_k)) for _ in range(batch)) if draw(st.booleans()) else None
    rope = draw(st.booleans()) and seq_q <= min(used or (seq_k,))  # every query sits at a table row
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, options, used, rope, seed


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(calls())
def test_gradients_match_the_oracle(host_build, call):
    dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, options, used, rope, seed = call
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(batch, heads_q, seq_q, head_dim, generator=g).to(DTYPES[dtype]) for _ in range(2))
    k, v = (torch.randn(batch, heads_kv, seq_k, head_dim, generator=g).to(DTYPES[dtype]) for _ in range(2))
    oracle_options = {name: value for name, value in options.items() if name != "deterministic"}
    if rope:
        cos, sin = rotary_tables(seq_k, head_dim if head_dim <= 64 else head_dim // 2)
        oracle_options.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=bool(seed % 2))
    seqused = None if used is None else torch.tensor(used, dtype=torch.int32)
    try:  # the host build leaves out some score-option kernels at some head_dims: refused with grad or without
        with torch.no_grad():
            flash_attn(q, k, v, seqused_k=seqused, **oracle_options)
    except UnsupportedError:
        assume(False)
    given_ = [t.clone() for t in (q, k, v, dout)]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn(*leaves, seqused_k=seqused, deterministic=options["deterministic"], **oracle_options)
    out.backward(dout)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, dout), given_))
    grads = [t.grad for t in leaves]
    for b in range(batch):
        n = seq_k if used is None else used[b]
        assert not grads[1][b, :, n:].any() and not grads[2][b, :, n:].any()  # keys past the count: none
        mine = (grads[0][b:b + 1], grads[1][b:b + 1, :, :n], grads[2][b:b + 1, :, :n])
        if n == 0:  # no key: nothing depends on anything
            assert not mine[0].any() and not out[b].any()
            continue
        inputs = (q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n])
        exact = attention_reference(*inputs, **oracle_options)
        assert ((out[b:b + 1].detach().double() - exact).abs() <= output_bound(exact, dtype)).all()
        # The backward's delta = rowsum(dO o O) reads O as the forward stored it (rounded to the
        # dtype), as FA-2's does: the gradients it computes are those of the loss sum(dO o O) -
        # sum(Delta lse), Delta the rows' rowsum(dO o (O stored - O exact)) (a change of delta by
        # Delta changes dS = P (dP - delta) by -P Delta, the gradient of -Delta lse). The oracle's
        # gradients of that loss leave the backward's own errors alone, where the dtype's rounding of
        # O would otherwise weigh most in small calls (a bf16 row of two keys, say).
        stored = out[b:b + 1].detach().double() - exact
        dlse = -(dout[b:b + 1].double() * stored).sum(-1)
        refs = attention_gradients(*inputs, dout[b:b + 1], dlse=dlse, **oracle_options)
        floor = cancellation_floor(q, k, v, dout)
        for name, got, ref in zip(("dq", "dk", "dv"), mine, refs):
            assert got.dtype == DTYPES[dtype] and torch.isfinite(got).all(), name
            err = (got.double() - ref).abs().max().item()
            bound = max(GRAD_TOL[DTYPES[dtype]] * ref.abs().max().item(), floor)
            assert err <= bound, f"{name}: {err:.2e}, bound {bound:.2e}"
