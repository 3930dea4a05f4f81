"""Property-based tests of flash_attn_with_kvcache on the host platform: random batches, GQA, cache
lengths (empty ones included), appends of new keys (RoPE on them and the queries), contiguous,
paged and row-indexed caches, left padding, causal masks and windows, softcaps, ALiBi, sinks and
key slices; the output and LSE against the float64 oracle on the cache as it should be after the
append, the cache written exactly there and nowhere else, a refused call writing nothing."""


import torch
from cases import TOLS, TORCH_DTYPES, property_examples, small_head_dims
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from rdnattention import attention_reference, flash_attn_with_kvcache, rotary_tables
from rdnattention.errors import UnsupportedError
from rdnattention.reference import rotate

DTYPES = TORCH_DTYPES
HEAD_DIMS = small_head_dims("dec")
TOL = TOLS  # (output, LSE) by dtype
EXAMPLES = property_examples()


@st.composite
def calls(draw):
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    # the built head_dims, or (padding.py, as flash-attn's entry) any up to 128: padded copies, the cache copied back
    head_dim = draw(st.sampled_from(HEAD_DIMS[dtype]) if draw(st.integers(0, 2)) else st.integers(1, 128))
    heads_kv = draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.sampled_from([1, 2, 4]))
    batch = draw(st.integers(1, 3))
    layout = draw(st.sampled_from(["contiguous", "paged", "rows"]))
    page = draw(st.sampled_from([4, 8, 16]))
    cache_len = page * draw(st.integers(1, 5)) if layout == "paged" else draw(st.integers(1, 60))
    seq_q = draw(st.integers(1, 4))
    new = draw(st.sampled_from([0, seq_q, min(draw(st.integers(0, 4)), cache_len)]))
    new = min(new, cache_len)
    lengths = [draw(st.integers(0, cache_len - new)) for _ in range(batch)]
    leftpad = ([draw(st.integers(0, n)) for n in lengths]
               if layout == "contiguous" and draw(st.booleans()) else None)
    causal = draw(st.booleans())
    window = (draw(st.integers(-1, 20)), draw(st.integers(-1, 6))) if draw(st.booleans()) else (-1, -1)
    softcap = draw(st.sampled_from([0.0, 0.0, 5.0]))
    alibi = draw(st.booleans()) and leftpad is None
    sinks = draw(st.booleans())
    # (positions in the cache, left padding or not)
    rope = draw(st.sampled_from([None, False, True])) if new and head_dim > 1 else None
    num_splits = draw(st.sampled_from([0, 0, 1, 3]))
    seed = draw(st.integers(0, 2**31 - 1))
    return (dtype, head_dim, heads_kv, heads_q, batch, layout, page, cache_len, seq_q, new, lengths, leftpad, causal,
            window, softcap, alibi, sinks, rope, num_splits, seed)


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(calls())
def test_matches_the_oracle_and_writes_only_the_new_keys(host_build, call):
    (dtype, head_dim, heads_kv, heads_q, batch, layout, page, cache_len, seq_q, new, lengths, leftpad, causal,
     window, softcap, alibi, sinks, rope, num_splits, seed) = call
    g = torch.Generator().manual_seed(seed)
    t = DTYPES[dtype]
    q = torch.randn(batch, seq_q, heads_q, head_dim, generator=g).to(t)
    k_cache, v_cache = (torch.randn(batch, cache_len, heads_kv, head_dim, generator=g).to(t) for _ in range(2))
    k, v = (torch.randn(batch, new, heads_kv, head_dim, generator=g).to(t) for _ in range(2)) if new else (None, None)
    kw = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32), causal=causal, window_size=window,
              softcap=softcap, num_splits=num_splits, return_softmax_lse=True)
    if leftpad is not None:
        kw["cache_leftpad"] = torch.tensor(leftpad, dtype=torch.int32)
    slopes = torch.rand(heads_q, generator=g) if alibi else None
    if alibi:
        kw["alibi_slopes"] = slopes
    logits = torch.randn(heads_q, generator=g) if sinks else None
    if sinks:
        kw["sinks"] = logits
    tables = None
    if rope is not None:
        cos, sin = rotary_tables(cache_len + seq_q, (head_dim // 2 if head_dim > 64 else head_dim) // 2 * 2)
        tables = (cos, sin, rope)
        kw.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rope)

    # The caches the call is given: the logical [batch, cache_len] caches laid out as ``layout`` says.
    if layout == "paged":
        pages = batch * cache_len // page
        order = torch.randperm(pages + 2, generator=g)[:pages].to(torch.int32)  # two pages no sequence owns
        given_k, given_v = (torch.randn(pages + 2, page, heads_kv, head_dim, generator=g).to(t) for _ in range(2))
        given_k[order.long()], given_v[order.long()] = (c.reshape(-1, page, heads_kv, head_dim) for c in (k_cache, v_cache))
        kw["block_table"] = order.view(batch, cache_len // page)
        logical = lambda c: c[order.long()].reshape(batch, cache_len, heads_kv, head_dim)  # noqa: E731
    elif layout == "rows":
        idx = torch.randperm(batch + 1, generator=g)[:batch].to(torch.int32)  # one row no sequence owns
        given_k, given_v = (torch.randn(batch + 1, cache_len, heads_kv, head_dim, generator=g).to(t) for _ in range(2))
        given_k[idx.long()], given_v[idx.long()] = k_cache, v_cache
        kw["cache_batch_idx"] = idx
        logical = lambda c: c[idx.long()]  # noqa: E731
    else:
        given_k, given_v = k_cache.clone(), v_cache.clone()
        logical = lambda c: c  # noqa: E731
    before = [x.clone() for x in (q, given_k, given_v)]
    try:
        out, lse = flash_attn_with_kvcache(q, given_k, given_v, k, v, **kw)
    except UnsupportedError:  # a kernel the host build leaves out: refused, nothing written
        assert all(torch.equal(a, b) for a, b in zip((q, given_k, given_v), before))
        assume(False)
    assert torch.equal(q, before[0])
    event("served: " + ("built head_dim" if head_dim in HEAD_DIMS[dtype] else "padded head_dim") + f", {layout}")

    # The caches as they should be: the new keys (rotated) at each sequence's length, nothing else.
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    local = causal or window != (-1, -1)
    atol, lse_tol = TOL[dtype]
    for b, n in enumerate(lengths):
        qb = q[b:b + 1].transpose(1, 2)
        if new:
            kb = k[b:b + 1].transpose(1, 2)
            if tables is not None:  # (16-bit in, 16-bit out: rounded once, as the append kernels round)
                kb = rotate(kb, cos, sin, torch.arange(new) + n, rope)
                qpos = torch.arange(seq_q) + n if local else torch.full((seq_q,), n)
                qb = rotate(qb, cos, sin, qpos, rope)
            expect_k[b, n:n + new] = kb[0].transpose(0, 1)
            expect_v[b, n:n + new] = v[b]
        first = 0 if leftpad is None else leftpad[b]
        used = slice(first, n + new)
        ref, ref_lse = attention_reference(
            qb, expect_k[b:b + 1, used].transpose(1, 2), expect_v[b:b + 1, used].transpose(1, 2),
            is_causal=causal, window_size=window, return_lse=True, softcap=softcap, alibi_slopes=slopes,
            sinks=logits)
        assert (out[b].double() - ref[0].transpose(0, 1)).abs().max().item() <= atol, f"sequence {b}"
        finite = torch.isfinite(ref_lse[0])
        assert torch.equal(torch.isfinite(lse[b]), finite), f"sequence {b}"
        if finite.any():
            assert (lse[b].double()[finite] - ref_lse[0][finite]).abs().max().item() <= lse_tol, f"sequence {b}"
    assert torch.equal(logical(given_k), expect_k) and torch.equal(logical(given_v), expect_v)
    if layout == "paged":  # the pages no sequence owns: untouched
        spare = torch.ones(pages + 2, dtype=torch.bool)
        spare[order.long()] = False
        assert torch.equal(given_k[spare], before[1][spare]) and torch.equal(given_v[spare], before[2][spare])
    elif layout == "rows":
        spare = torch.ones(batch + 1, dtype=torch.bool)
        spare[idx.long()] = False
        assert torch.equal(given_k[spare], before[1][spare]) and torch.equal(given_v[spare], before[2][spare])
