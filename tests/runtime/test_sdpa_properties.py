"""Property-based tests of the SDPA patch on the host platform: random shapes, GQA, masks that are
bands of keys per sequence (key padding on either side, causal alignments, windows, rows that see
no key), given as bool or additive masks, and masks that are not bands, with and without
gradients; each call's output and gradients against torch's own function in float32, the inputs
left as they were given, and every band served by the kernels."""


import pytest
import torch
import torch.nn.functional as F
from cases import TORCH_DTYPES, TORCH_TOLS, property_examples, small_head_dims
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rdnattention

ORIGINAL = F.scaled_dot_product_attention
DTYPES = TORCH_DTYPES
HEAD_DIMS = small_head_dims("f16")
TOL = TORCH_TOLS
EXAMPLES = property_examples()


@pytest.fixture(autouse=True)
def _never_left_patched(sdpa_restored):  # conftest: unpatched after every test
    yield


@st.composite
def bands(draw, batch: int, seq_q: int, seq_k: int):
    """Per sequence, keys [k0, k1) and, for query i, keys i + lo .. i + hi of them (either bound
    possibly absent): [batch, 1, seq_q, seq_k] bool, or one [seq_q, seq_k] for every sequence."""
    shared = draw(st.booleans())
    lo = draw(st.one_of(st.none(), st.integers(-seq_q, seq_k)))
    hi = draw(st.one_of(st.none(), st.integers(-seq_q, seq_k)))
    if lo is not None and hi is not None and hi < lo:
        lo, hi = hi, lo
    i, j = torch.arange(seq_q)[:, None], torch.arange(seq_k)
    masks = []
    for _ in range(1 if shared else batch):
        k0 = draw(st.integers(0, seq_k))
        k1 = draw(st.integers(k0, seq_k))
        m = ((j >= k0) & (j < k1)).expand(seq_q, seq_k)
        if lo is not None:
            m = m & (j >= i + lo)
        if hi is not None:
            m = m & (j <= i + hi)
        masks.append(m)
    return masks[0] if shared else torch.stack(masks)[:, None]


@st.composite
def calls(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    head_dim = draw(st.sampled_from(HEAD_DIMS[dtype]))
    heads_kv = draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.integers(1, 2))
    batch = draw(st.integers(1, 3))
    seq_q = draw(st.integers(1, 40))
    seq_k = draw(st.integers(1, 50))
    kind = draw(st.sampled_from(["none", "is_causal", "band", "band additive", "random"]))
    mask = None
    if kind.startswith("band"):
        mask = draw(bands(batch, seq_q, seq_k))
    elif kind == "random":
        mask = torch.rand(batch, 1, seq_q, seq_k, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))) < 0.5
    if kind == "band additive":
        mask = torch.zeros(mask.shape, dtype=draw(st.sampled_from([DTYPES[dtype], torch.float32]))).masked_fill(
            ~mask, float("-inf"))
    grad = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, kind, mask, grad, seed


def _float32(q, k, v, dout, **kw):
    """torch's function in float32 on the same values: the output and, where dout is given, the
    gradients of q, k and v."""
    mask = kw.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kw["attn_mask"] = mask.float()
    leaves = [t.float().requires_grad_(dout is not None) for t in (q, k, v)]
    with torch.enable_grad():
        out = ORIGINAL(*leaves, **kw)
        if dout is None:
            return out.detach(), None
        out.backward(dout.float())
    return out.detach(), [t.grad for t in leaves]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_calls_match_torch_and_bands_are_served(host_build, call):
    dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, kind, mask, grad, seed = call
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(batch, heads_q, seq_q, head_dim, generator=g).to(DTYPES[dtype]) for _ in range(2))
    k, v = (torch.randn(batch, heads_kv, seq_k, head_dim, generator=g).to(DTYPES[dtype]) for _ in range(2))
    kw = {"enable_gqa": heads_q != heads_kv}
    if kind == "is_causal":
        kw["is_causal"] = True
    elif mask is not None:
        kw["attn_mask"] = mask
    given_ = [t.clone() for t in (q, k, v, dout)] + ([mask.clone()] if mask is not None else [])
    leaves = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    with rdnattention.sdpa_patched(devices="cpu", strict=True):
        rdnattention.stats(reset=True)
        out = F.scaled_dot_product_attention(*leaves, **kw)
        if grad:
            out.backward(dout)
        stats = rdnattention.stats()
    assert all(torch.equal(a, b) for a, b in zip((q, k, v, dout, mask), given_))
    assert out.dtype == DTYPES[dtype] and out.shape == q.shape
    if kind != "random":  # a band: the kernels serve it, forward and backward
        assert (stats["served"], stats["fallbacks"]) == (1, {}), stats
    ref, ref_grads = _float32(q, k, v, dout if grad else None, **kw)
    out_tol, grad_tol = TOL[dtype]
    torch.testing.assert_close(out.detach().float(), ref.nan_to_num(0.0), atol=out_tol, rtol=out_tol)
    if grad:
        for name, leaf, ref_grad in zip(("dq", "dk", "dv"), leaves, ref_grads):
            assert leaf.grad.dtype == DTYPES[dtype], name
            torch.testing.assert_close(leaf.grad.float(), ref_grad.nan_to_num(0.0), atol=grad_tol, rtol=grad_tol,
                                       msg=lambda m, name=name: f"{name}: {m}")
