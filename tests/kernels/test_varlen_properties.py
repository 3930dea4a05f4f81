"""Property-based tests of the packed entry points on the host platform: varlen_attn and
flash_attn_varlen_func on random sequence lengths (sequences without queries or keys included),
GQA, causal masks and windows, softcaps, ALiBi per head or per sequence, sinks, per-sequence key
counts, paged pools and key slices; each sequence's output and LSE against the float64 oracle on
its own rows and keys, and the inputs left as they were given."""


import torch
from cases import TOLS, TORCH_DTYPES, property_examples, small_head_dims
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rdnattention import attention_reference, flash_attn_varlen_func, varlen_attn
from rdnattention.errors import UnsupportedError

DTYPES = TORCH_DTYPES
HEAD_DIMS = {name: sorted(set(dims) | set(small_head_dims("dec")[name]))
             for name, dims in small_head_dims("f16", "varlen").items()}
TOL = TOLS  # (output, LSE) by dtype
EXAMPLES = property_examples()


class _Aux:  # torch.nn.attention.varlen.AuxRequest's field
    lse = True


@st.composite
def calls(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    entry = draw(st.sampled_from(["varlen_attn", "flash_attn_varlen_func"]))
    # flash-attn's entry also takes any head_dim up to 128 (padding.py: padded copies, the output sliced back)
    padding = entry == "flash_attn_varlen_func" and not draw(st.integers(0, 2))
    head_dim = draw(st.integers(1, 128) if padding else st.sampled_from(HEAD_DIMS[dtype]))
    heads_kv = draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.sampled_from([1, 2, 4]))
    batch = draw(st.integers(1, 4))
    paged = entry == "flash_attn_varlen_func" and draw(st.booleans())
    page = draw(st.sampled_from([4, 8, 16]))
    lengths_q = [draw(st.sampled_from([0, 1, 1, draw(st.integers(0, 24))])) for _ in range(batch)]
    lengths_k = [draw(st.integers(0, 40)) for _ in range(batch)]
    used = ([draw(st.integers(0, n)) for n in lengths_k]
            if entry == "varlen_attn" and draw(st.booleans()) else None)
    causal = draw(st.booleans())
    window = (draw(st.integers(-1, 20)), draw(st.integers(-1, 8))) if draw(st.booleans()) else (-1, -1)
    softcap = draw(st.sampled_from([0.0, 0.0, 5.0]))
    alibi = draw(st.sampled_from([None, "head", "sequence"]))
    sinks = draw(st.booleans())
    num_splits = draw(st.sampled_from([None, 1, 3])) if entry == "varlen_attn" else None
    extra = (draw(st.integers(0, 3)), draw(st.integers(0, 3)))  # max_q, max_k beyond the longest
    seed = draw(st.integers(0, 2**31 - 1))
    return (dtype, head_dim, heads_kv, heads_q, batch, entry, paged, page, lengths_q, lengths_k, used, causal,
            window, softcap, alibi, sinks, num_splits, extra, seed)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(calls())
def test_each_sequence_matches_the_oracle(host_build, call):
    (dtype, head_dim, heads_kv, heads_q, batch, entry, paged, page, lengths_q, lengths_k, used, causal, window,
     softcap, alibi, sinks, num_splits, extra, seed) = call
    g = torch.Generator().manual_seed(seed)
    t = DTYPES[dtype]
    cu = lambda n: torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lengths_q), heads_q, head_dim, generator=g).to(t)
    k, v = (torch.randn(sum(lengths_k), heads_kv, head_dim, generator=g).to(t) for _ in range(2))
    cu_q, cu_k = cu(lengths_q), cu(lengths_k)
    max_q, max_k = max(lengths_q) + extra[0], max(lengths_k) + extra[1]
    slopes = {None: None, "head": torch.rand(heads_q, generator=g),
              "sequence": torch.rand(batch, heads_q, generator=g)}[alibi]
    logits = torch.randn(heads_q, generator=g) if sinks else None
    keys, values, table = k, v, None
    if paged:  # each sequence's keys in pages of a shuffled pool (two pages no sequence owns)
        per = -(-max(max(lengths_k), 1) // page)
        order = torch.randperm(batch * per + 2, generator=g)[:batch * per]
        keys, values = (torch.randn(batch * per + 2, page, heads_kv, head_dim, generator=g).to(t) for _ in range(2))
        for b in range(batch):
            rows = slice(int(cu_k[b]), int(cu_k[b + 1]))
            for pool, src in ((keys, k), (values, v)):
                flat = torch.zeros(per * page, heads_kv, head_dim, dtype=t)
                flat[:lengths_k[b]] = src[rows]
                pool[order[b * per:(b + 1) * per]] = flat.view(per, page, heads_kv, head_dim)
        table = order.view(batch, per).to(torch.int32)
        max_k = per * page
    before = [x.clone() for x in (q, keys, values)]
    try:
        if entry == "varlen_attn":
            win = (window[0], 0) if causal and window[1] < 0 else window
            out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, return_aux=_Aux(), window_size=win,
                                   enable_gqa=heads_q != heads_kv, softcap=softcap, alibi_slopes=slopes, sinks=logits,
                                   seqused_k=None if used is None else torch.tensor(used, dtype=torch.int32),
                                   num_splits=num_splits)
            causal = win[1] == 0 and causal
            window = win
        else:
            out, lse, _ = flash_attn_varlen_func(q, keys, values, cu_q, cu_k, max_q, max_k, causal=causal,
                                                 window_size=window, softcap=softcap, alibi_slopes=slopes,
                                                 return_attn_probs=True, block_table=table, sinks=logits)
    except UnsupportedError:  # a kernel the host build leaves out: refused, nothing written
        assert all(torch.equal(a, b) for a, b in zip((q, keys, values), before))
        assume(False)
    assert all(torch.equal(a, b) for a, b in zip((q, keys, values), before))
    assert out.shape == q.shape and out.dtype == t and lse.shape == (heads_q, q.shape[0])
    atol, lse_tol = TOL[dtype]
    view = lambda x: x.unsqueeze(0).transpose(1, 2)  # noqa: E731  [total, h, d] -> [1, h, total, d]
    for b in range(batch):
        qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
        if qs.stop == qs.start:
            continue
        n = lengths_k[b] if used is None else used[b]
        ks = slice(int(cu_k[b]), int(cu_k[b]) + n)
        ref, ref_lse = attention_reference(
            view(q[qs]), view(k[ks]), view(v[ks]), return_lse=True, is_causal=causal, window_size=window,
            softcap=softcap, alibi_slopes=slopes[b] if alibi == "sequence" else slopes, sinks=logits)
        assert (view(out[qs]).double() - ref).abs().max().item() <= atol, f"sequence {b}"
        got = lse[:, qs].unsqueeze(0).double()
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(got), finite), f"sequence {b}"
        if finite.any():
            assert (got[finite] - ref_lse[finite]).abs().max().item() <= lse_tol, f"sequence {b}"
