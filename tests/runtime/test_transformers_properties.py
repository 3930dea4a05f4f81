"""Property-based tests of the transformers integration's attention function on the host platform:
the masks transformers builds for padded batches (left or right padding, per-sequence lengths),
causal or not, sliding windows, queries at the end of a longer cache, softcaps and learned sinks
(gpt-oss's s_aux), with and without gradients; the valid rows' output and the gradients (of a
loss that ignores the padding rows, as training's labels do) against a float64 reference of the
same attention, the inputs left as they were given, and every such mask read by the kernels'
path (a fallback only where the host build has no kernel)."""


import pytest
import torch
from cases import TORCH_DTYPES, TORCH_TOLS, property_examples, small_head_dims
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
import rdnattention.integrations.transformers as rt  # noqa: E402

DTYPES = TORCH_DTYPES
HEAD_DIMS = small_head_dims("f16")
TOL = TORCH_TOLS
EXAMPLES = property_examples()


@st.composite
def calls(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    head_dim = draw(st.sampled_from(HEAD_DIMS[dtype]))
    heads_kv = draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.integers(1, 2))
    batch = draw(st.integers(1, 3))
    seq_k = draw(st.integers(1, 40))
    padding = draw(st.sampled_from(["none", "left", "right"]))
    # right padding: training's whole sequences (seq_q = seq_k); otherwise the queries may be the
    # last positions of a longer cache (prefill after a prompt, decode)
    seq_q = seq_k if padding == "right" else draw(st.integers(1, seq_k))
    lengths = [draw(st.integers(1, seq_k)) if padding != "none" else seq_k for _ in range(batch)]
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, seq_k))) if causal else None
    softcap = draw(st.one_of(st.none(), st.floats(2.0, 50.0)))
    sinks = draw(st.booleans())
    grad = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return (dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, padding, lengths, causal, window, softcap,
            sinks, grad, seed)


def _visible(batch, seq_q, seq_k, padding, lengths, causal, window):
    """[batch, 1, seq_q, seq_k] bool, as transformers' masks: query i at position seq_k - seq_q + i,
    keys at the valid positions (the last ``lengths[b]`` with left padding, the first with right),
    causal, and a sliding window of ``window`` keys (its own and window - 1 before)."""
    pos = torch.arange(seq_k - seq_q, seq_k)[:, None]
    j = torch.arange(seq_k)
    masks = []
    for n in lengths:
        valid = j >= seq_k - n if padding == "left" else j < n
        m = valid.expand(seq_q, seq_k)
        if causal:
            m = m & (j <= pos)
        if window is not None:
            m = m & (j > pos - window)
        masks.append(m)
    return torch.stack(masks)[:, None]


def _reference(q, k, v, visible, scale, softcap, sinks):
    """Attention in float64 with the mask ``visible``: a row that sees no key gives zero (with sinks:
    all its weight on the sink, zero as well)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    top = s.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    p = torch.exp(s - top)
    p = p / p.sum(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
    if sinks is not None:
        p = p[..., :-1]
    return (p @ v).transpose(1, 2)  # [batch, seq_q, heads, head_dim]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_attention_matches_a_float64_reference(host_build, call):
    (dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, padding, lengths, causal, window, softcap, sinks,
     grad, seed) = call
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, seq_q, head_dim, generator=g).to(DTYPES[dtype])
    k, v = (torch.randn(batch, heads_kv, seq_k, head_dim, generator=g).to(DTYPES[dtype]) for _ in range(2))
    s_aux = torch.randn(heads_q, generator=g) if sinks else None
    visible = _visible(batch, seq_q, seq_k, padding, lengths, causal, window)
    # transformers passes no mask for whole causal sequences of equal length, and its 4-D bool mask otherwise
    mask = None if padding == "none" and causal and window is None and seq_q == seq_k else visible
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = causal, heads_q // heads_kv
    module.train(grad)
    kwargs = {"scaling": None, "dropout": 0.0, "is_causal": causal}
    if window is not None:
        kwargs["sliding_window"] = window
    if softcap is not None:
        kwargs["softcap"] = softcap
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    if s_aux is not None:
        kwargs["s_aux"] = s_aux.clone().requires_grad_(grad)
    given_ = [t.clone() for t in (q, k, v, visible)]
    rt.counts(reset=True)
    with torch.set_grad_enabled(grad):
        out, _ = rt.attention_forward(module, *leaves, mask, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, visible), given_))
    # The masks transformers makes are read: a fallback is only a kernel the host build leaves out.
    assert all(reason.startswith("no ") for reason in rt.counts()["fallbacks"]), rt.counts()
    assert out.dtype == DTYPES[dtype] and out.shape == (batch, seq_q, heads_q, head_dim)

    # The rows of valid query positions; the others are padding, whose output training ignores.
    pos = torch.arange(seq_k - seq_q, seq_k)
    rows = torch.stack([pos >= seq_k - n if padding == "left" else pos < n for n in lengths])  # [batch, seq_q]
    leaves64 = [t.double().requires_grad_(grad) for t in (q, k, v)]
    sinks64 = s_aux.double().requires_grad_(grad) if s_aux is not None else None
    with torch.set_grad_enabled(grad):
        ref = _reference(*leaves64, visible, head_dim ** -0.5, softcap, sinks64)
    out_tol, grad_tol = TOL[dtype]
    torch.testing.assert_close(out.detach()[rows].double(), ref.detach()[rows], atol=out_tol, rtol=out_tol)
    if grad:
        dout = torch.randn(out.shape, generator=g).to(DTYPES[dtype]) * rows[:, :, None, None]
        out.backward(dout)
        ref.backward(dout.double())
        ours = [t.grad for t in leaves] + ([kwargs["s_aux"].grad] if s_aux is not None else [])
        refs = [t.grad for t in leaves64] + ([sinks64.grad] if s_aux is not None else [])
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), ours, refs):
            assert a is not None, name
            torch.testing.assert_close(a.double(), b, atol=grad_tol, rtol=grad_tol,
                                       msg=lambda m, name=name: f"{name}: {m}")
