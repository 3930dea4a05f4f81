"""Property-based checks of the custom ops' fake implementations (what torch.compile and
torch.export trace with) against the ops themselves: for random shapes (no zero-size dimension:
opcheck's copy of its arguments cannot make one, torch._dynamo.utils.clone_input),
layouts (head-major, token-major views, rows inside wider buffers; either output layout), GQA ratios, windows and
options, torch.library.opcheck's fake-tensor test finds the fake's outputs of the real ones'
shapes, strides and dtypes: the dense forward and backward ops, the packed forward (the decode op
over cu_seqlens) and backward, and flash_attn_with_kvcache's op (appending, with and without
cache_leftpad; it writes the caches, which opcheck checks it says it does)."""

import torch
from cases import TORCH_DTYPES, property_examples, small_head_dims
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rdnattention.errors import UnsupportedError

HEAD_DIMS = small_head_dims("f16", limit=64)
EXAMPLES = property_examples(25)
FAKE = ("test_schema", "test_faketensor")
# Every test's: draws the host build has no kernel for are set aside (_served)
PROPERTY = settings(max_examples=EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _heads(draw) -> tuple[str, int, int, int]:
    """(dtype, head_dim, K/V heads, query heads): the draws every op's calls start from."""
    dtype = draw(st.sampled_from(sorted(TORCH_DTYPES)))
    heads_kv = draw(st.integers(1, 2))
    return dtype, draw(st.sampled_from(HEAD_DIMS[dtype])), heads_kv, heads_kv * draw(st.integers(1, 2))


@st.composite
def calls(draw):
    dtype, head_dim, heads_kv, heads_q = _heads(draw)
    batch = draw(st.integers(1, 2))
    seq_q, seq_k = draw(st.integers(1, 20)), draw(st.integers(1, 24))
    layouts = [draw(st.sampled_from(["head_major", "token_major", "padded"])) for _ in range(3)]
    window = (draw(st.integers(-1, 10)), draw(st.integers(-1, 10)))
    used = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, layouts, window, used, seed


def _tensor(g, shape, layout, dtype):
    batch, heads, seq, dim = shape
    if layout == "token_major":  # [batch, heads, seq, head_dim] view of token-major storage
        return torch.randn(batch, seq, heads, dim, generator=g).to(dtype).transpose(1, 2)
    if layout == "padded":  # rows inside a wider buffer
        return torch.randn(batch, heads, seq, dim + 8, generator=g).to(dtype)[..., :dim]
    return torch.randn(shape, generator=g).to(dtype)


def _inputs(call):
    dtype, head_dim, heads_kv, heads_q, batch, seq_q, seq_k, layouts, window, used, seed = call
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads_q, seq_q, head_dim), (batch, heads_kv, seq_k, head_dim), (batch, heads_kv, seq_k, head_dim))
    q, k, v = (_tensor(g, s, layout, TORCH_DTYPES[dtype]) for s, layout in zip(shapes, layouts))
    seqused = torch.randint(0, seq_k + 1, (batch,), generator=g, dtype=torch.int32) if used else None
    return q, k, v, seqused


def _served(op, args):
    """``op(*args)``; a call the host build has no kernel for is not drawn (opcheck would report
    its UnsupportedError as a failure)."""
    try:
        return op(*args)
    except UnsupportedError:
        assume(False)


@PROPERTY
@given(calls(), st.booleans(), st.booleans())
def test_forward_fake_matches_the_op(host_build, call, return_lse, token_major):
    q, k, v, seqused = _inputs(call)
    args = (q, k, v, None, None, *call[8], 0.125, False, return_lse, token_major, seqused)  # token_major: the output's
    _served(torch.ops.rdnattention.flash_attn_fwd, args)
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_fwd.default, args, test_utils=FAKE)


@PROPERTY
@given(calls(), st.booleans())
def test_backward_fake_matches_the_op(host_build, call, deterministic):
    q, k, v, seqused = _inputs(call)
    window = call[8]
    out, lse = _served(torch.ops.rdnattention.flash_attn_fwd, (q, k, v, None, None, *window, 0.125, False, True, False,
                                                               seqused))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(call[-1])).to(q.dtype)
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_bwd.default,
                          (dout, q, k, v, out, lse, None, *window, 0.125, 0.0, deterministic, None, seqused),
                          test_utils=FAKE)


@st.composite
def packed_calls(draw):
    dtype, head_dim, heads_kv, heads_q = _heads(draw)
    lengths_q = draw(st.lists(st.integers(0, 12), min_size=1, max_size=3))
    lengths_k = [draw(st.integers(0, 16)) for _ in lengths_q]
    assume(sum(lengths_q) and sum(lengths_k))  # opcheck cannot copy a zero-size argument
    wide = draw(st.booleans())  # rows inside wider buffers
    window = (draw(st.integers(-1, 10)), draw(st.integers(-1, 10)))
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, head_dim, heads_kv, heads_q, lengths_q, lengths_k, wide, window, seed


@PROPERTY
@given(packed_calls(), st.booleans())
def test_packed_forward_and_backward_fakes_match_the_ops(host_build, call, deterministic):
    dtype, head_dim, heads_kv, heads_q, lengths_q, lengths_k, wide, window, seed = call
    g = torch.Generator().manual_seed(seed)

    def packed(total, heads):
        t = torch.randn(total, heads, head_dim + (8 if wide else 0), generator=g).to(TORCH_DTYPES[dtype])
        return t[..., :head_dim]
    q, dout = packed(sum(lengths_q), heads_q), packed(sum(lengths_q), heads_q)
    k, v = packed(sum(lengths_k), heads_kv), packed(sum(lengths_k), heads_kv)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
                  for n in (lengths_q, lengths_k))
    batch, max_q, max_k = len(lengths_q), max(lengths_q), max(lengths_k)
    args = (q, k, v, None, None, None, cu_q, cu_k, batch, max_q, max_k, *window, 0.125, True, 0)
    out, lse = _served(torch.ops.rdnattention.flash_attn_decode_fwd, args)
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_decode_fwd.default, args, test_utils=FAKE)
    _served(torch.ops.rdnattention.flash_attn_varlen_bwd, (dout, q, k, v, out, lse, None, cu_q, cu_k, max_q, max_k,
                                                           *window, 0.125, 0.0, deterministic))
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_varlen_bwd.default,
                          (dout, q, k, v, out, lse, None, cu_q, cu_k, max_q, max_k, *window, 0.125, 0.0, deterministic),
                          test_utils=FAKE)


@st.composite
def cache_calls(draw):
    dtype, head_dim, heads_kv, heads_q = _heads(draw)
    batch, seq_q, cache_len = draw(st.integers(1, 2)), draw(st.integers(1, 4)), draw(st.integers(8, 40))
    new = draw(st.integers(1, seq_q))  # the op serves calls that append (or have cache_leftpad)
    used = [draw(st.integers(0, cache_len - new)) for _ in range(batch)]
    leftpad = [draw(st.integers(0, n)) for n in used] if draw(st.booleans()) else None
    causal, return_lse = draw(st.booleans()), draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, head_dim, heads_kv, heads_q, batch, seq_q, cache_len, new, used, leftpad, causal, return_lse, seed


@PROPERTY
@given(cache_calls())
def test_cache_op_fake_matches_the_op(host_build, call):
    dtype, head_dim, heads_kv, heads_q, batch, seq_q, cache_len, new, used, leftpad, causal, return_lse, seed = call
    g = torch.Generator().manual_seed(seed)
    t = TORCH_DTYPES[dtype]
    q = torch.randn(batch, seq_q, heads_q, head_dim, generator=g).to(t)
    k_cache, v_cache = (torch.randn(batch, cache_len, heads_kv, head_dim, generator=g).to(t) for _ in range(2))
    k, v = (torch.randn(batch, new, heads_kv, head_dim, generator=g).to(t) for _ in range(2))
    lengths = torch.tensor(used, dtype=torch.int32)
    pad = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32)
    window = (-1, 0) if causal else (-1, -1)
    args = (q, k_cache, v_cache, k, v, None, None, lengths, None, None, *window, 0.125, True, causal, return_lse, 0,
            pad)
    _served(torch.ops.rdnattention.flash_attn_kvcache_fwd, tuple(a.clone() if isinstance(a, torch.Tensor) else a
                                                                 for a in args))
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_kvcache_fwd.default, args, test_utils=FAKE)
