"""Property-based test of the eager replay (rdnattention/replay.py): sequences of calls drawn from a
few geometries, so that most calls replay a plan kept for an earlier one, each differing from the
ones before in what a replay key must tell apart or must not (the softcap's value, the scale, the
window, causal, the output's layout, cache lengths, seqused_k's values, the keys' length, views
of one buffer), every call checked against the float64 oracle."""


import torch
from cases import TOL, property_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdnattention import attention_reference, flash_attn, flash_attn_func, flash_attn_with_kvcache

EXAMPLES = property_examples(25)  # sequences of up to 8 calls each


@st.composite
def geometries(draw):
    """What a call's replay key holds that the test varies: entry, shapes, layout."""
    return dict(entry=draw(st.sampled_from(["flash_attn", "flash_attn_func", "kvcache"])),
                batch=draw(st.integers(1, 2)), heads_kv=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2])),
                seq_q=draw(st.sampled_from([1, 3, 17])), seq_k=draw(st.sampled_from([5, 40, 300])),
                view=draw(st.booleans()))


@st.composite
def options(draw):
    return dict(causal=draw(st.booleans()),
                window=draw(st.sampled_from([(-1, -1), (6, 0), (6, 2)])),
                softcap=draw(st.sampled_from([0.0, 4.0, 4.5])),
                scale=draw(st.sampled_from([None, 0.1, 0.2])),
                lse=draw(st.booleans()),
                used=draw(st.sampled_from([None, "full", "short"])),
                grow=draw(st.sampled_from([0, 0, 1, 2])))


@st.composite
def sequences(draw):
    pool = draw(st.lists(geometries(), min_size=1, max_size=3))
    return [(draw(st.sampled_from(pool)), draw(options()), draw(st.integers(0, 2**31 - 1)))
            for _ in range(draw(st.integers(2, 8)))]


def _check(out, lse, ref, ref_lse):
    assert (out.double() - ref).abs().max().item() <= TOL
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        if finite.any():
            assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= TOL


def _run(geometry, opts, seed):
    g = torch.Generator().manual_seed(seed)
    b, hk, seq_q = geometry["batch"], geometry["heads_kv"], geometry["seq_q"]
    hq, d = hk * geometry["group"], 64
    seq_k = geometry["seq_k"] + opts["grow"]  # a cache one or two keys longer: the length-following replay
    window = opts["window"]
    oracle = dict(is_causal=opts["causal"], window_size=window, softmax_scale=opts["scale"], softcap=opts["softcap"],
                  return_lse=True)
    if geometry["entry"] == "kvcache":
        cache = seq_k + 8
        q = torch.randn(b, seq_q, hq, d, generator=g).half()
        k_cache, v_cache = (torch.randn(b, cache, hk, d, generator=g).half() for _ in range(2))
        lengths = torch.randint(0, seq_k + 1, (b,), generator=g, dtype=torch.int32)
        if opts["used"] is None:
            lengths = seq_k  # an int: the same length for every sequence
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=opts["causal"],
                                           window_size=window, softmax_scale=opts["scale"], softcap=opts["softcap"],
                                           return_softmax_lse=True)
        counts = [lengths] * b if isinstance(lengths, int) else lengths.tolist()
        for i, n in enumerate(counts):
            ref, ref_lse = attention_reference(q[i:i + 1].transpose(1, 2), k_cache[i:i + 1, :n].transpose(1, 2),
                                               v_cache[i:i + 1, :n].transpose(1, 2), **oracle)
            _check(out[i:i + 1].transpose(1, 2), lse[i:i + 1], ref, ref_lse)
        return
    if geometry["view"]:  # K and V the first seq_k rows of a longer buffer (DynamicCache-like views)
        buf = torch.randn(2, b, hk, seq_k + 5, d, generator=g).half()
        k, v = buf[0, :, :, :seq_k], buf[1, :, :, :seq_k]
    else:
        k, v = (torch.randn(b, hk, seq_k, d, generator=g).half() for _ in range(2))
    q = torch.randn(b, hq, seq_q, d, generator=g).half()
    used = None
    if opts["used"] is not None and geometry["entry"] == "flash_attn":
        used = torch.full((b,), seq_k, dtype=torch.int32)
        if opts["used"] == "short":
            used = torch.randint(0, seq_k + 1, (b,), generator=g, dtype=torch.int32)
    if geometry["entry"] == "flash_attn":
        out, lse = flash_attn(q, k, v, is_causal=opts["causal"], window_size=window, softmax_scale=opts["scale"],
                              softcap=opts["softcap"], seqused_k=used, return_lse=True)
    else:
        out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      softmax_scale=opts["scale"], causal=opts["causal"], window_size=window,
                                      softcap=opts["softcap"], return_attn_probs=True)
        out = out.transpose(1, 2)
    counts = [seq_k] * b if used is None else used.tolist()
    for i, n in enumerate(counts):
        ref, ref_lse = attention_reference(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], **oracle)
        _check(out[i:i + 1], lse[i:i + 1], ref, ref_lse)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences())
def test_each_call_of_a_sequence_matches_the_oracle(host_build, calls):
    for geometry, opts, seed in calls:
        _run(geometry, opts, seed)
