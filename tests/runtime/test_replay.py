"""Per-call host work paid once per geometry (rdnattention/replay.py): every entry point keeps the
plan of each geometry it has seen and replays it, the values and memory of each call still checked;
split-KV scratch comes from a per-stream (on the host: per-thread) workspace (workspace.py)."""

import re
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import rdnattention
from rdnattention import dispatch, drivers, plan_flash_attn, reference, replay, route, workspace
from rdnattention.errors import InvalidArgumentError
from rdnattention.int8 import _torch_quantize

from cases import TOL, counted_express, fresh_replays, property_examples
from hypothesis import given, settings
from hypothesis import strategies as st

needs_guards = pytest.mark.skipif(replay._TensorGuards is None,
                                  reason="this torch has no TensorGuards (torch._C._dynamo.guards)")


def _cache_inputs(seed, paged=False, rows=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, rows, 4, 64, generator=g).half()
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, generator=g).half() for _ in range(2))
    if paged:
        k_cache, v_cache = k_cache.view(8, 16, 2, 64), v_cache.view(8, 16, 2, 64)
    k, v = (torch.randn(2, rows, 2, 64, generator=g).half() for _ in range(2))
    return q, k_cache, v_cache, k, v


def _packed(seed, rows, keys):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2 * rows, 4, 64, generator=g).half(), torch.randn(2 * keys, 2, 64, generator=g).half(),
            torch.randn(2 * keys, 2, 64, generator=g).half())


def _int8(seed, rows):
    """Quantized inputs, by the torch formula: the quantizers' own replays stay out of the cache the
    tests count."""
    g = torch.Generator().manual_seed(seed)
    (q, qs), (k, ks) = (_torch_quantize("x", torch.randn(1, h, n, 64, generator=g), -1)
                        for h, n in ((4, rows), (2, 80)))
    v, vs = _torch_quantize("v", torch.randn(1, 2, 80, 64, generator=g), 2)
    return q, k, v, qs, ks, vs


TABLE = torch.tensor([[7, 0, 5, 2], [1, 6, 3, 4]], dtype=torch.int32)
LENGTHS = torch.tensor([10, 40], dtype=torch.int32)
CU_1 = torch.tensor([0, 1, 2], dtype=torch.int32)
CU_40 = torch.tensor([0, 40, 80], dtype=torch.int32)
CU_30 = torch.tensor([0, 30, 60], dtype=torch.int32)


def _call(entry, seed):
    """One call of ``entry`` on inputs of one geometry, drawn from ``seed``; returns what it
    returned and the tensors it wrote (the caches of an append)."""
    g = torch.Generator().manual_seed(seed)
    if entry.startswith("flash_attn."):
        q, k = torch.randn(2, 4, 1 if "decode" in entry else 30, 64, generator=g).half(), \
            torch.randn(2, 2, 300, 64, generator=g).half()
        kw = {"flash_attn.decode": {}, "flash_attn.prefill": dict(is_causal=True, return_lse=True),
              "flash_attn.seqused": dict(seqused_k=torch.tensor([300, 7], dtype=torch.int32)),
              "flash_attn.rope": dict(rotary_cos=rdnattention.rotary_tables(300, 32)[0],
                                      rotary_sin=rdnattention.rotary_tables(300, 32)[1])}[entry]
        return rdnattention.flash_attn(q, k, k.flip(2), **kw), ()
    if entry == "flash_attn_func":
        q, k = torch.randn(2, 30, 4, 64, generator=g).half(), torch.randn(2, 300, 2, 64, generator=g).half()
        return rdnattention.flash_attn_func(q, k, k.flip(1), causal=True, return_attn_probs=True)[:2], ()
    if entry == "sdpa":
        q, k = torch.randn(2, 4, 30, 64, generator=g).half(), torch.randn(2, 2, 300, 64, generator=g).half()
        return rdnattention.scaled_dot_product_attention(q, k, k.flip(2), is_causal=True, enable_gqa=True), ()
    if entry.startswith("kvcache"):
        return _kvcache_call(entry, seed, return_softmax_lse=True)
    if entry == "varlen.decode":
        q, k, v = _packed(seed, 1, 40)
        return rdnattention.varlen_attn(q, k, v, CU_1, CU_40, 1, 40, enable_gqa=True, num_splits=3), ()
    if entry == "varlen.prefill":
        q, k, v = _packed(seed, 30, 30)
        return rdnattention.flash_attn_varlen_func(q, k, v, CU_30, CU_30, 30, 30, causal=True,
                                                   return_attn_probs=True)[:2], ()
    if entry == "varlen.paged":
        q, k_cache, v_cache, _, _ = _cache_inputs(seed, paged=True)
        return rdnattention.flash_attn_varlen_func(q[:, 0], k_cache, v_cache, CU_1, torch.tensor(
            [0, 10, 50], dtype=torch.int32), 1, 64, block_table=TABLE), ()
    if entry == "int8.quantized":  # the quant kernel's launch and the attention's, replayed together
        q = torch.randn(1, 4, 30, 64, generator=g).half()
        k, v = (torch.randn(1, 2, 80, 64, generator=g).half() for _ in range(2))
        return rdnattention.flash_attn_int8qk_quantized(q, k, v, is_causal=True, return_lse=True), ()
    if entry.startswith("int8"):
        return rdnattention.flash_attn_int8qk(*_int8(seed, 1 if "decode" in entry else 30), is_causal=True), ()
    raise AssertionError(entry)


def _kvcache_call(entry, seed, **over):
    """flash_attn_with_kvcache on _cache_inputs(seed) as ``entry`` names it (paged, append, rope,
    rows, int, splits), ``over`` its other arguments: (its result, (k_cache, v_cache))."""
    paged = "paged" in entry
    q, k_cache, v_cache, k, v = _cache_inputs(seed, paged=paged)
    kw = dict(cache_seqlens=LENGTHS, causal=True)
    if paged:
        kw["block_table"] = TABLE
    if "append" in entry or "rope" in entry:
        kw.update(k=k, v=v)
    if "rope" in entry:
        kw["rotary_cos"], kw["rotary_sin"] = rdnattention.rotary_tables(64, 32)
    if "rows" in entry:
        kw["cache_batch_idx"] = torch.tensor([1, 0], dtype=torch.int32)
    if "int" in entry:
        kw["cache_seqlens"] = 30
    if "splits" in entry:
        kw["num_splits"] = 3
    kw.update(over)
    return rdnattention.flash_attn_with_kvcache(q, k_cache, v_cache, **kw), (k_cache, v_cache)


ENTRIES = ["flash_attn.decode", "flash_attn.prefill", "flash_attn.seqused", "flash_attn.rope", "flash_attn_func",
           "sdpa", "kvcache", "kvcache.append", "kvcache.rope", "kvcache.int", "kvcache.rows", "kvcache.paged",
           "kvcache.paged.append", "kvcache.splits", "varlen.decode", "varlen.prefill", "varlen.paged", "int8.decode",
           "int8.prefill", "int8.quantized"]


def _flat(result):
    out = []
    for x in (result if isinstance(result, (tuple, list)) else (result,)):
        out += _flat(x) if isinstance(x, (tuple, list)) else [x]
    return out


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_second_call_of_a_geometry_replays_its_plan_with_the_same_results(host_build, monkeypatch, entry):
    monkeypatch.setattr(replay, "cache", {})
    planned = _call(entry, 1)
    assert len(replay.cache) == 1  # kept
    launched = []
    monkeypatch.setattr(route, "plan", lambda *a, **kw: launched.append(a) or pytest.fail("planned again"))
    again = _call(entry, 2)  # other values, one geometry: replayed
    assert len(replay.cache) == 1 and not launched
    monkeypatch.undo()
    monkeypatch.setattr(replay, "cache", {})
    fresh = _call(entry, 2)  # the same call planned from scratch
    for a, b in zip(_flat(again), _flat(fresh)):
        assert torch.equal(a, b)
        # laid out alike (a replay allocates its outputs from stand-ins: replay.stand_in)
        assert (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)
    assert len(_flat(planned)) == len(_flat(fresh))


@pytest.mark.parametrize("entry, spoil, message", [
    ("kvcache.append", lambda: LENGTHS.__setitem__(1, 64),
     "cache_seqlens + seq_new (1) must lie in [0, cache_len = 64]"),
    ("kvcache.paged", lambda: TABLE.__setitem__((1, 1), 8), "block_table values must lie in [0, 7]"),
    ("varlen.decode", lambda: CU_40.__setitem__(2, 90), "cu_seq_k ends at 90, past the 80 packed rows"),
    ("varlen.prefill", lambda: CU_30.__setitem__(1, 31),
     "a sequence of 31 rows in cu_seqlens_q is longer than max_seqlen_q = 30"),
    ("varlen.paged", lambda: TABLE.__setitem__((0, 0), -1), "block_table values must lie in [0, 7]"),
])
def test_a_replayed_call_still_refuses_the_values_it_reads(host_build, monkeypatch, entry, spoil, message):
    """CPU tensors' values are read on every call, replayed ones too."""
    monkeypatch.setattr(replay, "cache", {})
    saved = (TABLE.clone(), LENGTHS.clone(), CU_40.clone(), CU_30.clone())
    try:
        _call(entry, 1)
        spoil()
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            _call(entry, 2)
        assert len(replay.cache) == 1
    finally:
        for t, s in zip((TABLE, LENGTHS, CU_40, CU_30), saved):
            t.copy_(s)


def test_a_replayed_seqused_k_and_int8_scale_are_still_read(host_build, monkeypatch):
    monkeypatch.setattr(replay, "cache", {})
    q, k = torch.randn(2, 4, 1, 64).half(), torch.randn(2, 2, 30, 64).half()
    used = torch.tensor([30, 3], dtype=torch.int32)
    rdnattention.flash_attn(q, k, k, seqused_k=used)
    used[0] = 31
    with pytest.raises(InvalidArgumentError, match=r"seqused_k values must lie in \[0, seq_k = 30\]"):
        rdnattention.flash_attn(q, k, k, seqused_k=used)
    args = _int8(3, 1)
    rdnattention.flash_attn_int8qk(*args)
    args[4][0, 1, 7] = float("nan")
    with pytest.raises(InvalidArgumentError, match="k_scale must hold positive finite scales"):
        rdnattention.flash_attn_int8qk(*args)


@pytest.mark.parametrize("entry, break_it, message", [
    ("kvcache.append", lambda t: t.untyped_storage().resize_(8), "k_cache's shape"),
    ("varlen.decode", lambda t: t.untyped_storage().resize_(0), "k has no memory behind it"),
    ("int8.decode", lambda t: t.untyped_storage().resize_(0), "k has no memory behind it"),
])
def test_a_replayed_call_still_checks_the_memory_behind_its_tensors(host_build, monkeypatch, entry, break_it, message):
    monkeypatch.setattr(replay, "cache", {})
    _call(entry, 1)
    if entry == "kvcache.append":
        real = _cache_inputs

        def broken(seed, paged=False, rows=1):
            q, k_cache, v_cache, k, v = real(seed, paged, rows)
            break_it(k_cache)
            return q, k_cache, v_cache, k, v
        monkeypatch.setitem(globals(), "_cache_inputs", broken)
    elif entry == "varlen.decode":
        real_packed = _packed

        def broken_packed(seed, rows, keys):
            q, k, v = real_packed(seed, rows, keys)
            break_it(k)
            return q, k, v
        monkeypatch.setitem(globals(), "_packed", broken_packed)
    else:
        real_int8 = _int8

        def broken_int8(seed, rows):
            q, k, v, qs, ks, vs = real_int8(seed, rows)
            break_it(k)
            return q, k, v, qs, ks, vs
        monkeypatch.setitem(globals(), "_int8", broken_int8)
    with pytest.raises(InvalidArgumentError, match=message):
        _call(entry, 2)


# --- the split-KV workspace --------------------------------------------------------------------

def _decode(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 8, 1, 64, generator=g).half(), torch.randn(1, 2, 2000, 64, generator=g).half()


def test_split_kv_calls_reuse_their_threads_workspace(host_build, monkeypatch):
    monkeypatch.setattr(replay, "cache", {})
    workspace.release()
    q, k = _decode(0)
    split = plan_flash_attn(q, k, k, kernel=None)
    assert split.scratch_bytes and split.counters  # several slices
    allocated = []
    allocate = workspace.allocate
    monkeypatch.setattr(workspace, "allocate", lambda n, d: allocated.append(n) or allocate(n, d))
    first = rdnattention.flash_attn(q, k, k)
    for _ in range(3):
        assert torch.equal(rdnattention.flash_attn(q, k, k), first)
    assert len(allocated) == 1  # once for the thread, then reused
    other = []
    thread = threading.Thread(target=lambda: other.append(rdnattention.flash_attn(q, k, k)))
    thread.start()
    thread.join()
    assert len(allocated) == 2 and torch.equal(other[0], first)  # another thread: its own


def test_split_kv_calls_on_several_threads_at_once_keep_their_scratch_apart(host_build, monkeypatch):
    """The host emulator runs calls of several threads at once: each thread's workspace is its
    own, so every result equals the call made alone."""
    monkeypatch.setattr(replay, "cache", {})
    inputs = [_decode(seed) for seed in range(4)]
    alone = [rdnattention.flash_attn(q, k, k) for q, k in inputs]
    results: dict = {i: [] for i in range(4)}

    def work(i):
        q, k = inputs[i]
        for _ in range(5):
            results[i].append(rdnattention.flash_attn(q, k, k))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert len(results[i]) == 5 and all(torch.equal(r, alone[i]) for r in results[i])


def test_a_plan_runs_on_scratch_of_its_own(host_build):
    q, k = _decode(5)
    plan = plan_flash_attn(q, k, k)
    assert plan.scratch_bytes > 0 and not plan.launches[0].args.part_o  # allocated where it runs
    plan.run()
    first = plan.outputs[0].clone()
    buffers = len(plan.buffers)
    plan.run()
    assert len(plan.buffers) == buffers and torch.equal(plan.outputs[0], first)
    assert torch.equal(first, rdnattention.flash_attn(q, k, k))


# --- the table a device's tensors run -----------------------------------------------------------

def test_the_device_table_follows_the_environment_and_a_cleared_table_cache(host_build, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("RDNATTENTION_HOST_TARGET", raising=False)
    host = route.device_table(cpu)
    assert host.target == "host" and route.device_table(cpu) is host
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", "host_f32")
    assert route.device_table(cpu).target == "host_f32"
    monkeypatch.delenv("RDNATTENTION_HOST_TARGET")
    assert route.device_table(cpu) is host
    dispatch.table_for.cache_clear()
    reloaded = route.device_table(cpu)
    assert reloaded is not host and reloaded.target == "host"
    assert drivers.target_token(cpu)[0] is drivers.host


# --- replays that follow the keys' length ---------------------------------------------------------

def _growing(seed, lengths, token_major=False, offset=0):
    """Contiguous K/V of each length in ``lengths``, as a cache that grows by concatenation holds
    them (transformers' DynamicCache), views of one buffer each; ``offset`` elements into it."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 8, 1, 64, generator=g).half()
    most = max(lengths)
    kb, vb = (torch.randn(offset + 2 * most * 64, generator=g).half() for _ in range(2))
    shape = (lambda n: (1, n, 2, 64)) if token_major else (lambda n: (1, 2, n, 64))
    kv = [(kb[offset:offset + 2 * n * 64].view(shape(n)), vb[offset:offset + 2 * n * 64].view(shape(n)))
          for n in lengths]
    return (q.transpose(1, 2) if token_major else q), kv


def _fresh(call):
    """``call()`` planned from scratch: no kept replay, no current guard, and the entry points'
    express functions neither tried nor dropped."""
    kept = replay.cache, replay.by_length, replay._following, replay._guard, replay.LastExpress.run
    replay.cache, replay.by_length, replay._following, replay._guard = {}, {}, None, None
    replay.LastExpress.run = lambda self, options, *tensors: None
    try:
        return call()
    finally:
        replay.cache, replay.by_length, replay._following, replay._guard, replay.LastExpress.run = kept


def _keyed_path_alone(monkeypatch):
    """The entry points without the express functions they try first (replay.LastExpress), for a
    test of what the keyed path (key, guard, following) keeps or checks: a geometry's calls from its
    fourth on would skip it."""
    from rdnattention import api, varlen

    class Never(replay.LastExpress):
        def remember(self, *args):
            pass
    for name in ("_flash_express", "_func_express", "_sdpa_express"):
        monkeypatch.setattr(api, name, Never())
    monkeypatch.setattr(varlen, "_EXPRESS", {entry: Never() for entry in varlen._EXPRESS})


@pytest.mark.parametrize("entry", ["flash_attn", "flash_attn_func"])
def test_a_cache_growing_by_a_key_per_call_replays_without_planning(host_build, monkeypatch, entry):
    """A decode step on a cache one key longer than the last (a new key for the replay cache at every
    step) follows the kept replay: no validation or planning, the key slices chosen for its length,
    and the result the full path gives."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "by_length", {})
    monkeypatch.setattr(replay, "_following", None)
    token_major = entry == "flash_attn_func"
    fn = rdnattention.flash_attn_func if token_major else rdnattention.flash_attn
    lengths = list(range(1990, 2000)) + [3000, 2100]
    q, kv = _growing(0, lengths, token_major)
    first = fn(q, *kv[0])
    assert len(replay.by_length) == 1
    assert next(iter(replay.by_length.values())).last[1].scratch_bytes  # several slices
    planned = []
    plan = route.plan
    monkeypatch.setattr(route, "plan", lambda *a, **kw: planned.append(a) or plan(*a, **kw))
    results = [first] + [fn(q, k, v) for k, v in kv[1:]]
    assert not planned  # every length followed
    for (k, v), got in zip(kv, results):
        assert torch.equal(got, _fresh(lambda: fn(q, k, v)))


def test_a_followed_length_is_kept_for_the_next_layer(host_build, monkeypatch):
    """The replay a new length derives (replay.relength) is its entry's last (Following.last): the
    next call of the same length (the next layer of a decode step, its own cache of the same shape)
    replays it as it is, and gives the full path's result."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "by_length", {})
    monkeypatch.setattr(replay, "_following", None)
    q, kv = _growing(1, [1990, 1991], token_major=True)
    _, (k2, v2) = _growing(2, [1990, 1991], token_major=True)[1]  # another layer's cache, same shapes
    rdnattention.flash_attn_func(q, *kv[0])
    derived = []
    relength = replay.relength
    monkeypatch.setattr(replay, "relength", lambda *a: derived.append(a[1]) or relength(*a))
    first = rdnattention.flash_attn_func(q, *kv[1])
    second = rdnattention.flash_attn_func(q, k2, v2)
    assert derived == [1991]  # once for the length, not per layer
    assert torch.equal(first, _fresh(lambda: rdnattention.flash_attn_func(q, *kv[1])))
    assert torch.equal(second, _fresh(lambda: rdnattention.flash_attn_func(q, k2, v2)))


@needs_guards
def test_an_entry_point_makes_its_express_of_a_geometry_another_entry_point_replayed_first(host_build,
                                                                                          monkeypatch):
    """scaled_dot_product_attention and flash_attn share the replay of one geometry (one key, kept by
    the first). With a call of another geometry between them, flash_attn's calls still make its own
    express (the kept key and the guard's are equal, not the same object), which serves the calls
    after with the float64-checked result."""
    from rdnattention import api
    fresh_replays(monkeypatch)
    monkeypatch.setattr(api, "_flash_express", replay.LastExpress())
    monkeypatch.setattr(api, "_sdpa_express", replay.LastExpress())
    served = counted_express(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 8, 1, 64, generator=g).half()
    k, v = (torch.randn(1, 2, 300, 64, generator=g).half() for _ in range(2))
    q2, k2, v2 = (torch.randn(1, 4, 40, 64, generator=g).half() for _ in range(3))
    for _ in range(3):
        rdnattention.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for _ in range(2):  # (its own replay, and its guard the current one)
        rdnattention.flash_attn(q2, k2, v2)
    want = reference.attention_reference(q, k, v)
    for _ in range(4):
        got = rdnattention.flash_attn(q, k, v)
        assert (got.double() - want).abs().max().item() <= TOL
    assert api._flash_express.made
    assert served[-2:] == [True, True]  # the last calls went through it


@needs_guards
def test_the_follower_express_derives_a_launch_where_the_key_slices_change(host_build, monkeypatch):
    """A cache that grows from 100 to 1400 keys through flash_attn's express: a length of the
    served one's key slices rewrites the served launch's lengths and strides alone, and a length of
    other slices (the planner's count changes with the length) derives its launch anew
    (replay.relength). Each call equals the float64 oracle's result within the fp16 tolerance, and
    the call planned from scratch byte for byte."""
    from rdnattention import api
    fresh_replays(monkeypatch)
    monkeypatch.setattr(api, "_flash_express", replay.LastExpress())
    served = counted_express(monkeypatch)
    derived = []
    relength = replay.relength
    monkeypatch.setattr(replay, "relength", lambda *a: derived.append(a[1]) or relength(*a))
    lengths = list(range(100, 1400, 9))
    q, kv = _growing(11, lengths)
    for (k, v), n in zip(kv, lengths):
        got = rdnattention.flash_attn(q, k, v)
        want = reference.attention_reference(q, k, v)
        assert (got.double() - want).abs().max().item() <= TOL, n
        assert torch.equal(got, _fresh(lambda: rdnattention.flash_attn(q, k, v))), n
    slices = {replay.by_length[f].last[1].lengths.splits(n) for f in replay.by_length for n in lengths}
    assert len(slices) > 1  # the lengths span several slice counts
    assert len(lengths) - 10 <= sum(served)  # the express served all but the first calls
    assert 1 <= len(set(derived)) < len(lengths) // 4  # derived where the slices change, not per length


def _lengthed_by_definition(f, r, k, v):
    """What replay._lengthed computes, from its definition: K's length (V's must equal it, and be
    non-zero), the first three strides of each modulo f.per16 equal to f.residues, the reach of
    each (checks.reach) in r's reach, and the kernels' (batch, head, row) strides."""
    from rdnattention import checks
    seq_k = k.shape[f.seq_dim]
    if seq_k != v.shape[f.seq_dim] or not seq_k:
        return None
    if tuple(x % f.per16 for x in (*k.stride()[:3], *v.stride()[:3])) != f.residues:
        return None
    reach = list(r.reach)
    i, j = f.positions
    reach[i], reach[j] = (checks.reach(k), k.element_size()), (checks.reach(v), v.element_size())
    order = (0, 2, 1) if f.seq_dim == 1 else (0, 1, 2)
    return seq_k, tuple(k.stride()[d] for d in order), tuple(v.stride()[d] for d in order), tuple(reach)


@settings(max_examples=property_examples(200), deadline=None)
@given(seq_dim=st.sampled_from([1, 2]), seq_k=st.integers(0, 40), v_len=st.one_of(st.none(), st.integers(0, 40)),
       heads=st.integers(1, 4), pads=st.tuples(*(st.sampled_from([0, 0, 8, 1, 3]) for _ in range(4))),
       alike=st.booleans(), residues=st.sampled_from([None, (0,) * 6, (2, 0, 0, 2, 0, 0), (0, 3, 0, 0, 3, 0)]))
def test_a_new_lengths_checks_and_reach_are_those_of_their_definition(seq_dim, seq_k, v_len, heads, pads, alike,
                                                                      residues):
    """replay._lengthed (a followed cache's new length: V's length, the strides modulo 16 bytes, each
    tensor's reach, the kernels' strides) on K and V of any lengths and padded strides, alike or not,
    for followers of aligned strides and of other residues (None: those of this K and V, a follower
    of their class), gives what its definition gives. (V's length: K's where v_len is None.)"""
    from types import SimpleNamespace
    d = 8

    def cache(n, pad_row, pad_head):
        rows = [1, n, heads, d] if seq_dim == 1 else [1, heads, n, d]
        inner = (heads * (d + pad_row), d + pad_row) if seq_dim == 1 else (n * (d + pad_row) + pad_head, d + pad_row)
        strides = (max(1, rows[1] * inner[0] + pad_head) if seq_dim == 1 else max(1, heads * inner[0]), *inner, 1)
        return torch.empty_strided(rows, strides, dtype=torch.float16)

    k = cache(seq_k, pads[0], pads[1])
    v = (torch.empty_strided(k.shape, k.stride(), dtype=k.dtype) if alike
         else cache(seq_k if v_len is None else v_len, pads[2], pads[3]))
    if residues is None:
        residues = tuple(x % 8 for x in (*k.stride()[:3], *v.stride()[:3]))
    f = replay.Following(free=(), last=((), None), positions=(1, 2), seq_dim=seq_dim, per16=8, residues=residues,
                         aligned16=not any(residues))
    r = SimpleNamespace(reach=((64, 2), (100, 2), (100, 2), (16, 4)))  # the served call's: q, K, V, another
    want = _lengthed_by_definition(f, r, k, v)
    assert replay._lengthed(f, r, k.shape, k.stride(), v.shape, v.stride()) == want


@needs_guards
@pytest.mark.parametrize("entry", ["flash_attn", "flash_attn_func"])
def test_flash_attn_express_follows_a_growing_cache(host_build, monkeypatch, entry):
    """flash_attn's and flash_attn_func's express functions serve a cache one key longer at every
    step (two layers a step, as a model's), and then the same lengths again in another order, each
    call with the result of that call planned from scratch."""
    from rdnattention import api
    fresh_replays(monkeypatch)
    monkeypatch.setattr(api, "_flash_express", replay.LastExpress())
    monkeypatch.setattr(api, "_func_express", replay.LastExpress())
    served = counted_express(monkeypatch)
    q, kv = _growing(7, list(range(1990, 2002)), token_major=entry == "flash_attn_func")
    call = getattr(rdnattention, entry)
    for k, v in kv + kv[::-3]:
        for _ in range(2):
            got = call(q, k, v, softmax_scale=0.125)
            assert torch.equal(got, _fresh(lambda: call(q, k, v, softmax_scale=0.125)))
    assert sum(served) >= len(kv)  # most calls went through an express


@needs_guards
@pytest.mark.parametrize("entry", ["varlen_attn", "flash_attn_varlen_func"])
def test_packed_express_serves_only_the_options_it_was_made_under(host_build, monkeypatch, entry):
    """varlen_attn's and flash_attn_varlen_func's express functions (a geometry's calls past its
    third, where the offsets' values are not read: RDNATTENTION_CHECK=0 here) serve only a call with
    the options they were made under: the same tensors with other lengths, window, scale, softcap,
    key slices or causal flag get their own results; with the values read (the CPU's default) no
    express is tried, so bad offsets still raise."""
    from rdnattention import checks, varlen
    fresh_replays(monkeypatch)
    monkeypatch.setattr(varlen, "_EXPRESS", {e: replay.LastExpress(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
                                             for e in varlen._EXPRESS})
    monkeypatch.setattr(checks, "_mode", "never")
    express = varlen._EXPRESS[entry]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 64, generator=g).half()
    k, v = (torch.randn(80, 2, 64, generator=g).half() for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 40, 80], dtype=torch.int32)
    if entry == "varlen_attn":
        def call(max_k=40, window=(-1, -1), scale=None, softcap=0.0, splits=None, causal=False, cu_k=cu_k):
            return rdnattention.varlen_attn(q, k, v, cu_q, cu_k, 1, max_k, window_size=window, scale=scale,
                                            softcap=softcap, num_splits=splits, enable_gqa=True)
    else:
        def call(max_k=40, window=(-1, -1), scale=None, softcap=0.0, splits=None, causal=False, cu_k=cu_k):
            return rdnattention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max_k, softmax_scale=scale,
                                                       causal=causal, window_size=window, softcap=softcap)
    variants = [dict(max_k=50), dict(window=(7, 0)), dict(scale=0.11), dict(softcap=5.0), dict(causal=True),
                dict(splits=1), {}]
    for kw in variants:
        for one in ({},) * 4 + (kw,):  # the express made for the plain call's options, then kw's call
            assert express.made or one is not kw
            got = call(**one)
            assert torch.equal(got, _fresh(lambda: call(**one))), one
            window = one.get("window", (-1, -1))
            want = torch.cat([reference.attention_reference(
                q[b:b + 1, None].transpose(1, 2), k[40 * b:40 * b + 40][None].transpose(1, 2),
                v[40 * b:40 * b + 40][None].transpose(1, 2), window_size=(window[0], 0 if one.get("causal") else
                                                                          window[1]),
                softmax_scale=one.get("scale"), softcap=one.get("softcap", 0.0)).transpose(1, 2)[0]
                for b in range(2)])
            torch.testing.assert_close(got.double(), want, atol=TOL, rtol=0)
    monkeypatch.setattr(checks, "_mode", "auto")  # CPU offsets read: the full path's checks, not an express
    for _ in range(4):
        call()
    with pytest.raises(InvalidArgumentError):  # offsets past the 80 keys
        call(cu_k=torch.tensor([0, 40, 90], dtype=torch.int32))


def test_a_growing_cache_keeps_no_replay_per_length(host_build, monkeypatch):
    """Replays derived for lengths that pass are dropped, not kept (kept ones pile up for the garbage
    collector to scan, step after step): one per length-free key, the last. Calls of two lengths
    taking turns (the planned first length's and a derived one's) each get their own length's
    result."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "by_length", {})
    monkeypatch.setattr(replay, "_following", None)
    _keyed_path_alone(monkeypatch)
    lengths = list(range(1990, 2010))
    q, kv = _growing(3, lengths, token_major=True)
    for k, v in kv:
        rdnattention.flash_attn_func(q, k, v)
        rdnattention.flash_attn_func(q, k, v)  # the step's next layer
    (f,) = replay.by_length.values()
    assert len(replay.cache) == 1  # the planned first length alone
    assert f.last[0][3][0] == kv[-1][0].shape  # the last length's replay, no other
    for _ in range(2):
        for k, v in (kv[0], kv[-1]):
            got = rdnattention.flash_attn_func(q, k, v)
            assert torch.equal(got, _fresh(lambda: rdnattention.flash_attn_func(q, k, v)))
    assert len(replay.cache) == 1 and len(replay.by_length) == 1


@needs_guards
def test_a_growing_cache_is_recognised_by_its_entrys_guard(host_build, monkeypatch):
    """From the second length followed on, a call of the entry's geometry at any length is recognised
    by the entry's guard (K's and V's length and strides left free), without its key being looked
    up; a call the guard recognises whose K rows leave 16-byte alignment still goes to the full
    path and is refused, its tensors untouched."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "by_length", {})
    monkeypatch.setattr(replay, "_following", None)
    q, kv = _growing(5, list(range(1990, 1996)), token_major=False)
    for k, v in kv[:2]:
        rdnattention.flash_attn(q, k, v)
    assert replay._following is not None
    looked_up = []
    lookup = replay.lookup
    monkeypatch.setattr(replay, "lookup", lambda key: looked_up.append(key) or lookup(key))
    results = [rdnattention.flash_attn(q, k, v) for k, v in kv[2:]]
    assert not looked_up
    monkeypatch.setattr(replay, "lookup", lookup)
    for (k, v), got in zip(kv[2:], results):
        assert torch.equal(got, _fresh(lambda: rdnattention.flash_attn(q, k, v)))
    _, bad = _growing(5, [1996], token_major=False, offset=1)  # one fp16 element in: rows start off 16 bytes
    k, v = bad[0]
    before = [t.clone() for t in (q, k, v)]
    with pytest.raises(InvalidArgumentError, match="16-byte"):
        rdnattention.flash_attn(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


@needs_guards
def test_a_followed_length_called_again_gets_a_guard_of_its_own(host_build, monkeypatch):
    """A length followed from another's replay and then called again (a decode step's other layers,
    or a fixed-length call whose geometry another length planned) is recognised from its second call
    on by its own replay's guard, which key() tries first, as a planned key's is."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "by_length", {})
    monkeypatch.setattr(replay, "_following", None)
    monkeypatch.setattr(replay, "_guard", None)
    _keyed_path_alone(monkeypatch)
    q, kv = _growing(6, [1990, 1991, 1992])
    for k, v in kv:
        rdnattention.flash_attn(q, k, v)
    (f,) = replay.by_length.values()
    key, r = f.last
    assert r.guard is None  # each length called once
    k, v = kv[-1]
    rdnattention.flash_attn(q, k, v)
    assert r.guard and replay._guard is r.guard and r.guard.key is key
    got = rdnattention.flash_attn(q, k, v)
    assert torch.equal(got, _fresh(lambda: rdnattention.flash_attn(q, k, v)))


def test_a_length_that_changes_the_launches_is_planned_again(host_build, monkeypatch):
    """One key slice (no scratch) at a short cache, several at a long one: a replay kept
    for one is not followed for the other; the call is planned, and kept in turn."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "by_length", {})
    monkeypatch.setattr(replay, "_following", None)
    lengths = [16, 2000, 17, 2001, 18]  # at most two steps of 16 keys: one slice
    q, kv = _growing(1, lengths)
    planned = []
    plan = route.plan
    monkeypatch.setattr(route, "plan", lambda *a, **kw: planned.append(a[1].seq_k) or plan(*a, **kw))
    results = [rdnattention.flash_attn(q, k, v) for k, v in kv]
    assert planned == lengths
    for (k, v), got in zip(kv, results):
        assert torch.equal(got, _fresh(lambda: rdnattention.flash_attn(q, k, v)))


def test_a_followed_length_still_refuses_what_the_full_path_refuses(host_build, monkeypatch):
    """K/V rows off their 16-byte boundary at a new length: the call leaves the replay and is refused
    as a first call of that geometry is, its tensors untouched."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "by_length", {})
    monkeypatch.setattr(replay, "_following", None)
    q, kv = _growing(2, [1990, 1991])
    rdnattention.flash_attn(q, *kv[0])
    _, bad = _growing(2, [1991], offset=1)  # one fp16 element in: rows start off 16 bytes
    k, v = bad[0]
    before = [t.clone() for t in (q, k, v)]
    with pytest.raises(InvalidArgumentError, match="16-byte"):
        rdnattention.flash_attn(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


@pytest.mark.parametrize("guards", [True, False], ids=["by_guard", "by_key"])
def test_a_followed_length_refuses_v_shorter_than_k(host_build, monkeypatch, guards):
    """K and V of different lengths at a new length (the guard and the length-free key leave both
    lengths free): refused as the full path refuses them, not served with V read past its rows."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "by_length", {})
    monkeypatch.setattr(replay, "_following", None)
    if not guards:
        monkeypatch.setattr(replay, "_TensorGuards", None)
    q, kv = _growing(4, [1990, 1991, 1992, 1993])
    for k, v in kv:
        rdnattention.flash_attn(q, k, v)
    assert replay.by_length
    k = _growing(4, [2000])[1][0][0]
    v = _growing(5, [1200])[1][0][1]
    before = [t.clone() for t in (q, k, v)]
    with pytest.raises(InvalidArgumentError, match="must equal k shape"):
        rdnattention.flash_attn(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


def test_a_sliding_window_cache_that_outgrows_its_window_is_planned_for_its_length(host_build, monkeypatch):
    """A window of 100 keys on a cache of 60 (every key in it: validation clamps the window away)
    then of 1990: the second call is not the first's plan followed, which would drop its window."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "by_length", {})
    monkeypatch.setattr(replay, "_following", None)
    q, kv = _growing(3, [60, 1990, 1991])
    results = [rdnattention.flash_attn(q, k, v, window_size=(100, 0)) for k, v in kv]
    assert not replay.by_length
    for (k, v), got in zip(kv, results):
        want = reference.attention_reference(q, k, v, window_size=(100, 0))
        torch.testing.assert_close(got.double(), want, atol=TOL, rtol=0)


def test_rope_calls_are_planned_for_their_length(host_build, monkeypatch):
    """RoPE tables must cover the keys: a cache that grows past them is refused at the length where it
    does, not read past the tables' end by a followed plan."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "by_length", {})
    monkeypatch.setattr(replay, "_following", None)
    q, kv = _growing(4, [1990, 1991, 2001])
    cos, sin = rdnattention.rotary_tables(2000, 64)
    for k, v in kv[:2]:
        rdnattention.flash_attn(q, k, v, rotary_cos=cos, rotary_sin=sin)
    assert not replay.by_length
    with pytest.raises(InvalidArgumentError, match="rotary tables have 2000 positions"):
        rdnattention.flash_attn(q, *kv[2], rotary_cos=cos, rotary_sin=sin)


# --- a run of calls of one key: its guard ----------------------------------------------------------


@needs_guards
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_run_of_calls_of_one_key_is_recognised_by_its_guard(host_build, monkeypatch, entry):
    """From the third call in a row of one key on, the key is its guard's (one check of every
    tensor), and the call returns what the same call planned from scratch returns."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "_guard", None)
    _keyed_path_alone(monkeypatch)
    checked = []
    matches = replay.Guard.matches
    monkeypatch.setattr(replay.Guard, "matches", lambda self, tensors: checked.append(matches(self, tensors))
                        or checked[-1])
    for seed in range(3):
        _call(entry, seed)
    checked.clear()
    again = _call(entry, 3)
    assert checked and all(checked)
    fresh = _fresh(lambda: _call(entry, 3))
    for a, b in zip(_flat(again), _flat(fresh)):
        assert torch.equal(a, b)
        assert (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)


def test_a_guard_takes_a_tensor_given_twice_as_its_key_did(host_build, monkeypatch):
    """A tensor given as both k and v is checked once, and the guard recognises only calls that
    give one tensor there again (TensorGuards refuses aliases; the key does not see them)."""
    monkeypatch.setattr(replay, "cache", {})
    monkeypatch.setattr(replay, "_guard", None)
    q, k = _decode(1)
    first = rdnattention.flash_attn(q, k, k)
    for _ in range(3):
        assert torch.equal(rdnattention.flash_attn(q, k, k), first)
    guard = replay._guard
    assert guard is not None and guard.same == ((2, 1),)
    assert guard.matches((q, k, k, None, None, None, None, None))
    assert not guard.matches((q, k, k.clone(), None, None, None, None, None))
    other = k.flip(2)
    assert torch.equal(rdnattention.flash_attn(q, k, other), _fresh(lambda: rdnattention.flash_attn(q, k, other)))


class _Sub(torch.Tensor):
    pass


# What a call may give in place of one of the guarded call's tensors: ones its key tells apart and
# ones it does not (the guard may refuse more than the key does, never less).
VARIANTS = {
    "itself": lambda t: t,
    "a copy": lambda t: t.clone(),
    "strides of a transpose": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() > 1 else t[::2],
    "another dtype": lambda t: t.float() if t.dtype != torch.float32 else t.half(),
    "a negated view": lambda t: torch._neg_view(t),
    "requiring grad": lambda t: t.float().detach().requires_grad_() if t.is_floating_point() else None,
    "a subclass": lambda t: t.as_subclass(_Sub),
    "None": lambda t: None,
    "one row fewer": lambda t: t[:-1],
    "an expanded row": lambda t: t[:1].expand(t.shape),
    "another device": lambda t: t.to("meta"),
    "an inference tensor": lambda t: _inference(t),
}


def _inference(t):
    with torch.inference_mode():
        return t.clone()


@needs_guards
@settings(max_examples=property_examples(60), deadline=None)
@given(position=st.integers(0, 4), variant=st.sampled_from(sorted(VARIANTS)), grad=st.booleans(),
       inference=st.booleans())
def test_a_guarded_key_is_the_key_the_tensors_give(host_build, position, variant, grad, inference):
    """Whatever differs from the guarded call (a tensor's strides, dtype, negation, grad, type,
    presence, device; grad mode, inference mode), key() gives the key the tensors give it read one
    by one."""
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(2, 3, 4, 4, generator=g).half(), torch.randn(2, 5, 4, 4, generator=g).half(), None,
            torch.randn(5, 2, generator=g), torch.tensor([5, 3], dtype=torch.int32))
    options = (True, (-1, -1), float, 0.5)
    cpu = torch.device("cpu")
    kept = replay._last, replay._guard
    try:
        replay._last, replay._guard = (None, None, None), None
        first = replay.key("test", cpu, base, options)
        guard = replay.Guard.of("test", options, first, base, cpu, first[-1])
        assert guard is not None and guard.matches(base)
        made = VARIANTS[variant](base[position] if base[position] is not None else base[0])
        tensors = base[:position] + (made,) + base[position + 1:]
        mode = torch.inference_mode() if inference else torch.set_grad_enabled(grad)
        with mode:
            replay._guard = None
            expected = replay.key("test", cpu, tensors, options)
            replay._guard = guard
            got = replay.key("test", cpu, tensors, options)
        assert got == expected
        if got is not None and expected != first:
            assert got is not first
    finally:
        replay._last, replay._guard = kept


@needs_guards
def test_a_guard_gives_no_key_where_torch_traces_or_the_environment_moved_the_table(host_build, monkeypatch):
    q = torch.randn(1, 2, 3, 8).half()
    cpu = torch.device("cpu")
    options = (False,)
    monkeypatch.setattr(replay, "_last", (None, None, None))
    monkeypatch.delenv("RDNATTENTION_HOST_TARGET", raising=False)
    first = replay.key("test", cpu, (q, q), options)
    monkeypatch.setattr(replay, "_guard", replay.Guard.of("test", options, first, (q, q), cpu, first[-1]))
    assert replay.key("test", cpu, (q, q), options) is first
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", "host_f32")
    moved = replay.key("test", cpu, (q, q), options)
    assert moved is not None and moved != first and moved[-1] == id(route.device_table(cpu))
    monkeypatch.delenv("RDNATTENTION_HOST_TARGET")
    monkeypatch.setattr(replay, "_is_tracing", lambda: True)
    assert replay.key("test", cpu, (q, q), options) is None


@pytest.mark.parametrize("position", [0, 1, 4])
def test_a_negated_view_after_a_run_of_replays_is_refused_as_the_full_path_refuses_it(host_build, monkeypatch,
                                                                                       position):
    monkeypatch.setattr(replay, "cache", {})
    tensors = list(_cache_inputs(0))
    names = ["q", "k_cache", "v_cache", "k", "v"]

    def call(ts):
        q, k_cache, v_cache, k, v = ts
        return rdnattention.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=LENGTHS, causal=True)
    for _ in range(3):
        call(tensors)
    before = [t.clone() for t in tensors]
    tensors[position] = torch._neg_view(tensors[position])
    with pytest.raises(InvalidArgumentError, match=f"{names[position]} is a lazily negated or conjugated view"):
        call(tensors)
    for t, b in zip(tensors, before):  # nothing written
        assert torch.equal(t.resolve_neg(), -b if t.is_neg() else b)


@pytest.mark.parametrize("make, message", [
    (lambda q: torch.nested.nested_tensor([q[0], q[0]]), "q is a nested tensor"),
    (lambda q: q.to_sparse(), "q is of layout torch.sparse_coo"),
])
def test_a_nested_or_sparse_tensor_after_a_run_of_replays_is_a_typed_error(host_build, monkeypatch, make, message):
    """TensorGuards reads a nested tensor's sizes before its type and dispatch keys (torch's error
    there would end the process): the guard refuses it first, and the full path names it."""
    monkeypatch.setattr(replay, "cache", {})
    q, k = _decode(3)
    v = k.flip(2)
    for _ in range(3):
        rdnattention.flash_attn(q, k, v)
    assert replay._guard is not None
    with warnings.catch_warnings():  # (torch's prototype warning for nested tensors, once per process)
        warnings.simplefilter("ignore")
        bad = make(q)
    for call in (lambda: rdnattention.flash_attn(bad, k, v),
                 lambda: rdnattention.flash_attn_func(bad, k.transpose(1, 2), v.transpose(1, 2)),
                 lambda: rdnattention.flash_attn_with_kvcache(bad, k.transpose(1, 2), v.transpose(1, 2))):
        with pytest.raises(InvalidArgumentError, match=message):
            call()


@needs_guards
def test_transformers_attention_runs_a_repeated_geometry_through_its_express(host_build, monkeypatch):
    """Once a geometry's replay is recognised by its own guard, transformers' attention function
    runs that replay's express function (replay.express: the guard, the memory and the launch in one
    frame): the result of the same call planned from scratch. A call of another length, scale or
    geometry, or one after replay.clear(), takes the replay's own path, with its own result."""
    from types import SimpleNamespace

    from rdnattention.integrations import transformers as rt
    fresh_replays(monkeypatch)
    monkeypatch.setattr(rt, "_express", replay.LastExpress())
    served = counted_express(monkeypatch)
    module = SimpleNamespace(is_causal=True, training=False)

    def call(seed, keys=2000, scaling=0.125):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, h, n, 64, generator=g).half() for h, n in ((8, 1), (2, keys), (2, keys)))
        return rt.attention_forward(module, q, k, v, None, scaling=scaling)[0], (q, k, v)

    def planned(q, k, v, scaling=0.125):  # the same call with nothing kept
        replay.clear()
        return rt.attention_forward(module, q, k, v, None, scaling=scaling)[0]
    for seed in range(4):  # planned; replayed; its guard made; recognised by the guard, its express made
        call(seed)
    assert not served
    out, tensors = call(4)
    assert served == [True]
    fresh = planned(*tensors)
    assert served == [True, False]  # after clear(), the express refused the call: its guard is not current
    assert torch.equal(out, fresh) and (out.shape, out.stride()) == (fresh.shape, fresh.stride()) == ((1, 1, 8, 64),
                                                                                                   (512, 512, 64, 1))
    want = reference.attention_reference(*tensors, softmax_scale=0.125).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, atol=TOL, rtol=0)
    served.clear()
    for seed in range(5):  # planned again (planned()'s call): its own express serves the last calls
        call(seed)
    assert served and all(served)
    for keys, scaling in ((2001, 0.125), (2000, 0.5)):
        served.clear()
        out, tensors = call(7, keys, scaling)
        assert not any(served)  # the length: the express's guard refused it; the scale: not its options
        assert torch.equal(out, planned(*tensors, scaling=scaling))


@needs_guards
def test_transformers_attention_express_follows_a_growing_cache(host_build, monkeypatch):
    """Decode steps on caches one key longer per step (transformers' DynamicCache in generate()),
    several layers per step: the express of the last length's replay follows each new length as
    the entry's own path would (replay.follow, the entry's length-free guard), from the first layer
    of the step on, with no key built and nothing planned; each result is the one the same call
    planned from scratch gives, and the oracle's."""
    from types import SimpleNamespace

    from rdnattention.integrations import transformers as rt
    fresh_replays(monkeypatch)
    monkeypatch.setattr(rt, "_express", replay.LastExpress())
    module = SimpleNamespace(is_causal=True, training=False)
    lengths, layers = list(range(1990, 1998)), 3
    steps = [[_growing(10 * layer + n, [n]) for layer in range(layers)] for n in lengths]
    keys, planned = [], []
    key, plan = rdnattention.ops.key, route.plan
    results = []
    for i, step in enumerate(steps):
        if i == 3:  # the steps before: planned, followed, the entry's guard and the express made
            monkeypatch.setattr(rdnattention.ops, "key", lambda *a, **kw: keys.append(1) or key(*a, **kw))
            monkeypatch.setattr(route, "plan", lambda *a, **kw: planned.append(1) or plan(*a, **kw))
        for q, ((k, v),) in step:
            results.append(rt.attention_forward(module, q, k, v, None, scaling=0.125)[0])
    assert rt._express.made
    assert not keys and not planned  # five steps of three layers, every call through the express
    monkeypatch.setattr(rdnattention.ops, "key", key)
    monkeypatch.setattr(route, "plan", plan)
    calls = [(q, k, v) for step in steps for q, ((k, v),) in step]
    for (q, k, v), got in zip(calls, results):
        replay.clear()
        monkeypatch.setattr(rt, "_express", replay.LastExpress())
        fresh = rt.attention_forward(module, q, k, v, None, scaling=0.125)[0]
        assert torch.equal(got, fresh) and got.stride() == fresh.stride()
    q, k, v = calls[-1]
    want = reference.attention_reference(q, k, v, softmax_scale=0.125).transpose(1, 2)
    torch.testing.assert_close(results[-1].double(), want, atol=TOL, rtol=0)


@needs_guards
def test_transformers_attention_express_follows_a_cache_one_key_longer_at_every_call(host_build, monkeypatch):
    """A model of one layer decoding on a growing cache: every call a new length, none repeated. From
    the second length on the express of the entry's length-free guard serves the calls (no key built,
    nothing planned, no replay or guard kept per length); each result is the one the same call planned
    from scratch gives, and the oracle's."""
    from types import SimpleNamespace

    from rdnattention.integrations import transformers as rt
    fresh_replays(monkeypatch)
    monkeypatch.setattr(rt, "_express", replay.LastExpress())
    module = SimpleNamespace(is_causal=True, training=False)
    q, kv = _growing(21, list(range(1990, 2002)))
    keys, planned, results = [], [], []
    key, plan = rdnattention.ops.key, route.plan
    for i, (k, v) in enumerate(kv):
        if i == 2:  # planned, then followed: the express made
            monkeypatch.setattr(rdnattention.ops, "key", lambda *a, **kw: keys.append(1) or key(*a, **kw))
            monkeypatch.setattr(route, "plan", lambda *a, **kw: planned.append(1) or plan(*a, **kw))
        results.append(rt.attention_forward(module, q, k, v, None, scaling=0.125)[0])
    assert rt._express.made
    assert not keys and not planned  # ten calls at ten lengths, every one through the express
    assert len(replay.cache) == 1 and len(replay.by_length) == 1  # the first length's plan, its entry
    monkeypatch.setattr(rdnattention.ops, "key", key)
    monkeypatch.setattr(route, "plan", plan)
    for (k, v), got in zip(kv, results):
        fresh = _fresh(lambda: rt.attention_forward(module, q, k, v, None, scaling=0.125)[0])
        assert torch.equal(got, fresh) and got.stride() == fresh.stride()
    want = reference.attention_reference(q, *kv[-1], softmax_scale=0.125).transpose(1, 2)
    torch.testing.assert_close(results[-1].double(), want, atol=TOL, rtol=0)


@needs_guards
def test_a_following_express_leaves_to_the_full_path_what_it_refuses(host_build, monkeypatch):
    """The express that follows a growing cache returns None (the entry point's own path decides, and
    refuses) for V of another length than K, rows off their 16-byte boundary, memory short of what
    the shapes reach, another dtype, and once its entry is dropped (replay.clear)."""
    from types import SimpleNamespace

    from rdnattention.integrations import transformers as rt
    fresh_replays(monkeypatch)
    monkeypatch.setattr(rt, "_express", replay.LastExpress())
    module = SimpleNamespace(is_causal=True, training=False)
    q, kv = _growing(22, [1990, 1991, 1992])
    for k, v in kv:
        rt.attention_forward(module, q, k, v, None, scaling=0.125)
    run = rt._express.function
    assert run is not None
    k, v = _growing(22, [1995])[1][0]
    assert torch.equal(run(q, k, v), _fresh(lambda: rdnattention.flash_attn(q, k, v, softmax_scale=0.125))
                       .transpose(1, 2))
    assert run(q, k, _growing(23, [1200])[1][0][1]) is None  # V shorter than K
    off = _growing(22, [1996], offset=1)[1][0]  # one fp16 element in: rows start off 16 bytes
    assert run(q, *off) is None
    shrunk = k.clone()
    shrunk.untyped_storage().resize_(k.untyped_storage().nbytes() - 2)
    assert run(q, shrunk, v) is None
    assert run(q, k, v.float()) is None
    assert run(q, k, v) is not None
    replay.clear()
    assert run(q, k, v) is None


@needs_guards
def test_transformers_causal_calls_take_an_express_only_at_its_window(host_build, monkeypatch):
    """sdpa's causal flag is top-left: transformers' attention function gives the kernels a window
    that depends on the keys' length (or a slice of K and V where there are more keys than queries),
    so an express made at one length (followed there: the same K length, other strides) must not serve
    another. Each call, whichever path takes it, gives the float64 oracle's top-left causal result,
    the same as a call planned from scratch."""
    from types import SimpleNamespace

    from rdnattention.integrations import transformers as rt
    fresh_replays(monkeypatch)
    monkeypatch.setattr(rt, "_express", replay.LastExpress())
    module = SimpleNamespace(is_causal=True, training=False)
    g = torch.Generator().manual_seed(25)
    q = torch.randn(1, 8, 4, 64, generator=g).half()
    kb, vb = (torch.randn(2 * 16 * 64, generator=g).half() for _ in range(2))
    calls, results, served = [], [], 0
    # (4, 4): followed from (5, 5)'s plan, where an express is made, then repeated (after such repeats
    # the tree before this test served 7 keys wrongly, through its own guard's express)
    for n, capacity in [(5, 5), (4, 4), (6, 6), (4, 4), (4, 4), (4, 4), (7, 7), (4, 9), (3, 3), (3, 5), (8, 8)]:
        k, v = (b[:2 * capacity * 64].view(1, 2, capacity, 64)[:, :, :n] for b in (kb, vb))
        served += rt._express.function is not None
        calls.append((k, v))
        results.append(rt.attention_forward(module, q, k, v, None, scaling=0.125)[0])
    assert served >= 4  # an express stood before most calls (made at (4, 4), then (3, 5)'s own)
    for (k, v), got in zip(calls, results):
        fresh = _fresh(lambda: rt.attention_forward(module, q, k, v, None, scaling=0.125)[0])
        assert torch.equal(got, fresh), k.shape
        want = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(4, 1),
                                              v.double().repeat_interleave(4, 1), is_causal=True, scale=0.125)
        torch.testing.assert_close(got.double(), want.transpose(1, 2), atol=TOL, rtol=0)


@needs_guards
def test_a_following_express_is_made_again_under_a_changed_environment(host_build, monkeypatch):
    """A variable that decides devices' targets changes between calls: the followed cache's express
    leaves the call to the entry point's path, which makes the entry's express again under the new
    environment, and the calls after it take that one."""
    from types import SimpleNamespace

    from rdnattention.integrations import transformers as rt
    fresh_replays(monkeypatch)
    monkeypatch.setattr(rt, "_express", replay.LastExpress())
    module = SimpleNamespace(is_causal=True, training=False)
    q, kv = _growing(24, list(range(1990, 1997)))
    for k, v in kv[:3]:
        rt.attention_forward(module, q, k, v, None, scaling=0.125)
    first = rt._express.function
    assert first is not None
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "10.3.0")  # (no HIP device here: the host's table stays)
    assert first(q, *kv[3]) is None
    for k, v in kv[3:5]:
        rt.attention_forward(module, q, k, v, None, scaling=0.125)
    again = rt._express.function
    assert again is not None and again is not first
    k, v = kv[5]
    want = _fresh(lambda: rt.attention_forward(module, q, k, v, None, scaling=0.125)[0])
    assert torch.equal(again(q, k, v), want)


@needs_guards
@pytest.mark.parametrize("entry", ["kvcache", "kvcache.append", "kvcache.rope", "kvcache.paged.append",
                                   "kvcache.rows"])
def test_kvcache_runs_a_repeated_geometry_through_its_express(host_build, monkeypatch, entry):
    """Where the lengths' values are not read (RDNATTENTION_CHECK=0 here; GPU tensors by default),
    flash_attn_with_kvcache runs a geometry its replay's guard recognises through that replay's
    express (replay.express: the append's launch and its rotated queries' workspace region among
    its launches): the output and the cache writes of the same call planned from scratch. Another
    scale, an int cache_seqlens, or a call after replay.clear() takes the keyed path."""
    from rdnattention import checks, kvcache
    monkeypatch.setattr(checks, "_mode", "never")
    fresh_replays(monkeypatch)
    monkeypatch.setattr(kvcache, "_express", replay.LastExpress(()))
    served = counted_express(monkeypatch)

    def call(seed, **over):
        out, caches = _kvcache_call(entry, seed, **over)
        return out, *caches

    def planned(seed, **over):  # the same call with nothing kept
        replay.clear()
        return call(seed, **over)
    for seed in range(4):  # planned; replayed; its guard made; recognised by the guard, its express made
        call(seed)
    assert not served and kvcache._express.made
    got = call(4)
    assert served == [True]
    fresh = planned(4)
    assert served == [True, False]  # after clear(), the express refused the call: its guard is not current
    for a, b in zip(got, fresh):
        assert torch.equal(a, b) and a.stride() == b.stride()
    for seed in range(5):  # planned again (planned()'s call): its own express serves the last call
        call(seed)
    assert served[-1]
    for over in (dict(softmax_scale=0.5), dict(cache_seqlens=30)):
        served.clear()
        got = call(5, **over)
        assert not served  # not its options: the express is not tried
        for a, b in zip(got, planned(5, **over)):
            assert torch.equal(a, b)


@needs_guards
@pytest.mark.parametrize("entry", ["transformers", "kvcache.rope"])
def test_torch_compile_traces_past_a_standing_express(host_build, monkeypatch, entry):
    """torch.compile(fullgraph=True) of an entry point whose express stands (made by the eager calls
    before): the express steps aside before anything torch cannot trace, and the compiled call gives
    the eager call's result (and cache writes)."""
    from types import SimpleNamespace

    from rdnattention import checks, kvcache
    from rdnattention.integrations import transformers as rt
    monkeypatch.setattr(checks, "_mode", "never")
    fresh_replays(monkeypatch)
    monkeypatch.setattr(rt, "_express", replay.LastExpress())
    monkeypatch.setattr(kvcache, "_express", replay.LastExpress(()))
    module = SimpleNamespace(is_causal=True, training=False)
    if entry == "transformers":
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, n, 64, generator=g).half() for h, n in ((8, 1), (2, 300), (2, 300)))
        tensors = (q, k, v)

        def fn(q, k, v):
            return rt.attention_forward(module, q, k, v, None, scaling=0.125)[0] * 2
    else:
        q, k_cache, v_cache, k, v = _cache_inputs(0)
        cos, sin = rdnattention.rotary_tables(64, 32)
        tensors = (q, k_cache, v_cache, k, v)

        def fn(q, k_cache, v_cache, k, v):
            return rdnattention.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                                        cache_seqlens=LENGTHS, causal=True) * 2
    for _ in range(5):
        fn(*(t.clone() for t in tensors))
    assert (rt._express.function if entry == "transformers" else kvcache._express.function) is not None
    torch._dynamo.reset()
    compiled_in, eager_in = [t.clone() for t in tensors], [t.clone() for t in tensors]
    with torch.inference_mode():
        got = torch.compile(fn, fullgraph=True)(*compiled_in)
    assert torch.equal(got, fn(*eager_in))
    for a, b in zip(compiled_in, eager_in):
        assert torch.equal(a, b)


@needs_guards
def test_an_express_call_still_checks_the_memory_behind_its_tensors(host_build, monkeypatch):
    """replay.express refuses (None: the entry point's own path decides, and raises) tensors whose
    memory pointers() finds wanting, as the replay's own path does, and calls once its replay's
    guard is no longer the current one."""
    monkeypatch.setattr(replay, "cache", {})
    q, k = _decode(0)
    v = k.flip(2)
    from rdnattention.integrations import transformers as rt

    def key():
        return rdnattention.ops.key(q, k, v, is_causal=False, window_size=(-1, -1), softmax_scale=0.125,
                                    return_lse=False, token_major=True, views=True)
    for _ in range(3):  # planned, replayed, its guard made
        rt._unmasked(q, k, v, False, 0.125, 0.0, None)
    kept = key()  # the guard's
    assert rdnattention.ops.replayed(kept, q, k, v, return_lse=False, token_major=True, views=True) is not None
    r = replay.current(kept)
    run = replay.express(kept, q.device, ("q", "k", "v"), 3)
    assert run is not None and run is r.express is replay.express(kept, q.device, ("q", "k", "v"), 3)
    assert torch.equal(run(q, k, v), rdnattention.flash_attn(q, k, v, softmax_scale=0.125).transpose(1, 2))
    replay._set_guard(r.guard)
    shrunk = k.clone()
    shrunk.untyped_storage().resize_(k.untyped_storage().nbytes() - 2)
    assert run(q, shrunk, v) is None
    misaligned = torch.empty(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape).copy_(k)
    assert run(q, misaligned, v) is None
    assert run(q, k, v.float()) is None  # another dtype: the guard's
    replay.clear()
    assert run(q, k, v) is None
