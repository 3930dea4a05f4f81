"""Property-based test of flash-attn's entry behaviour (rdnattention/padding.py): flash_attn_func on
any head_dim up to 128 (padded to a multiple of 8 where it is not one) and on tensors whose rows the
kernels cannot read as they are (a strided last dimension, rows off 16-byte boundaries, strides
that are not multiples of 8 elements), with and without gradients, with the entry's options
(softmax_scale, softcap, ALiBi, sinks); the output, the LSE and the gradients against the float64
oracle, and the inputs left as they were given."""


import torch
from cases import GRAD_TOL, TOL, cancellation_floor, property_examples
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rdnattention import attention_gradients, attention_reference, flash_attn_func
from rdnattention.errors import UnsupportedError

EXAMPLES = property_examples()


@st.composite
def calls(draw):
    return dict(head_dim=draw(st.integers(1, 128)), batch=draw(st.integers(1, 2)), heads_kv=draw(st.integers(1, 2)),
                group=draw(st.sampled_from([1, 2])), seq_q=draw(st.integers(1, 30)), seq_k=draw(st.integers(1, 40)),
                layouts=[draw(st.sampled_from(["contiguous", "offset", "strided_last", "wide_rows", "heads_first"]))
                         for _ in range(3)],
                causal=draw(st.booleans()), grad=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
                # the entry's own options, passed through the padded call: a scale of the head_dim given
                # (the padded one's default would differ), a softcap, ALiBi, sinks
                scale=draw(st.sampled_from([None, None, 0.3])), softcap=draw(st.sampled_from([0.0, 0.0, 4.0])),
                alibi=draw(st.booleans()), sinks=draw(st.booleans()))


def _laid_out(x: torch.Tensor, layout: str, g: torch.Generator) -> torch.Tensor:
    """x [batch, seq, heads, dim] with the same values, in memory as ``layout`` says."""
    if layout == "offset":  # one element into a buffer: rows off 16-byte boundaries
        flat = torch.empty(x.numel() + 1, dtype=x.dtype)
        out = flat[1:].view(x.shape)
    elif layout == "strided_last":  # every other element
        out = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)[..., ::2]
    elif layout == "wide_rows":  # rows in a buffer one element wider than the head_dim
        out = torch.empty(*x.shape[:-1], x.shape[-1] + 1, dtype=x.dtype)[..., :-1]
    elif layout == "heads_first":  # [batch, heads, seq, dim] memory, token-major view
        out = torch.empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3], dtype=x.dtype).transpose(1, 2)
    else:
        out = torch.empty_like(x)
    out.copy_(x)
    return out


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(calls())
def test_any_head_dim_and_layout_matches_the_oracle(host_build, call):
    g = torch.Generator().manual_seed(call["seed"])
    d, b, hk, sq, sk = call["head_dim"], call["batch"], call["heads_kv"], call["seq_q"], call["seq_k"]
    hq = hk * call["group"]
    q = torch.randn(b, sq, hq, d, generator=g).half()
    k, v = (torch.randn(b, sk, hk, d, generator=g).half() for _ in range(2))
    dout = torch.randn(b, sq, hq, d, generator=g).half()
    given_ = [_laid_out(x, layout, g) for x, layout in zip((q, k, v), call["layouts"])]
    leaves = [x.requires_grad_(call["grad"]) for x in given_]
    options = dict(softmax_scale=call["scale"], softcap=call["softcap"],
                   alibi_slopes=torch.rand(hq, generator=g) if call["alibi"] else None,
                   sinks=torch.randn(hq, generator=g) if call["sinks"] else None)
    try:
        out, lse, _ = flash_attn_func(*leaves, causal=call["causal"], return_attn_probs=True, **options)
    except UnsupportedError:  # a padded head_dim (or its score option) the host build leaves out
        assume(False)
    assert all(torch.equal(x.detach(), y) for x, y in zip(leaves, (q, k, v)))
    assert out.shape == q.shape and out.dtype == torch.float16
    head_major = [x.transpose(1, 2) for x in (q, k, v)]
    ref, ref_lse = attention_reference(*head_major, is_causal=call["causal"], return_lse=True, **options)
    assert (out.transpose(1, 2).double() - ref).abs().max().item() <= TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= TOL
    if call["grad"]:
        out.backward(dout)
        # The backward's delta reads O as stored (fp16): the oracle's loss corrected for that, as
        # test_backward_properties.py's (the gradient of -sum(Delta lse), Delta = rowsum(dO o (O
        # stored - O exact))), where it would weigh most in small calls (a head_dim of 1, two keys).
        stored = out.detach().transpose(1, 2).double() - ref
        dlse = -(dout.transpose(1, 2).double() * stored).sum(-1)
        refs = attention_gradients(*head_major, dout.transpose(1, 2), dlse=dlse, is_causal=call["causal"], **options)
        floor = cancellation_floor(*head_major, dout.transpose(1, 2))
        for name, leaf, r in zip(("dq", "dk", "dv"), leaves, refs):
            got = leaf.grad.transpose(1, 2)
            assert got.shape == r.shape and got.dtype == torch.float16, name
            bound = max(GRAD_TOL[torch.float16] * r.abs().max().item(), floor)
            assert (got.double() - r).abs().max().item() <= bound, name
