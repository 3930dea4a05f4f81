"""The score transforms (softcap, alibi_slopes, sinks) at every entry point that takes them: typed
errors naming the argument for bad types, shapes, dtypes, devices and non-finite values (a refused
call leaves every tensor as it was); replayed calls keyed on them, so a call never runs a plan made
for other options; the int8 kernels refuse them by name. Their results against the oracle are in
the oracle sweep (tests/cases.py) and tests/kernels/test_model_rows.py."""

import re

import pytest
import torch

import rdnattention
from rdnattention import attention_reference, replay, route
from rdnattention.call import Layout, Option, Precision, Request
from rdnattention.errors import InvalidArgumentError, UnsupportedError

TOL = 2e-3
HQ, HK, D = 4, 2, 64


def _qkv(b=2, sq=20, sk=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, HQ, sq, D, generator=g).half(), torch.randn(b, HK, sk, D, generator=g).half(),
            torch.randn(b, HK, sk, D, generator=g).half())


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _call(entry: str, seed: int = 0, **score):
    """One call of ``entry`` with the score options ``score``: (output as [batch, heads, seq, d] or
    packed, the oracle's, the tensors the call was given)."""
    q, k, v = _qkv(seed=seed)
    if entry == "flash_attn":
        out = rdnattention.flash_attn(q, k, v, is_causal=True, **score)
        return out, attention_reference(q, k, v, is_causal=True, **score), (q, k, v)
    if entry == "flash_attn_func":
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out = rdnattention.flash_attn_func(qt, kt, vt, causal=True, **score).transpose(1, 2)
        return out, attention_reference(q, k, v, is_causal=True, **score), (qt, kt, vt)
    if entry == "kvcache":  # appends one key: a refused call must leave the cache as it was
        kc = k.transpose(1, 2).contiguous()
        vc = v.transpose(1, 2).contiguous()
        q1, knew, vnew = q[:, :, -1:].transpose(1, 2).contiguous(), kc[:, -1:].clone(), vc[:, -1:].clone()
        lengths = torch.tensor([69, 30], dtype=torch.int32)
        out = rdnattention.flash_attn_with_kvcache(q1, kc, vc, knew, vnew, cache_seqlens=lengths, causal=True,
                                                   **score)
        ref = attention_reference(q1.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), is_causal=True,
                                  seqused_k=lengths + 1, **score)
        return out.transpose(1, 2), ref, (q1, kc, vc, knew, vnew)
    if entry in ("varlen", "varlen_attn"):
        lq, lk = (20, 7), (70, 40)
        qp = torch.cat([q[b, :, :n].transpose(0, 1) for b, n in enumerate(lq)])
        kp = torch.cat([k[b, :, :n].transpose(0, 1) for b, n in enumerate(lk)])
        vp = torch.cat([v[b, :, :n].transpose(0, 1) for b, n in enumerate(lk)])
        if entry == "varlen":
            out = rdnattention.flash_attn_varlen_func(qp, kp, vp, _cu(lq), _cu(lk), 20, 70, causal=True, **score)
        else:
            out = rdnattention.varlen_attn(qp, kp, vp, _cu(lq), _cu(lk), 20, 70, window_size=(-1, 0),
                                           enable_gqa=True, **score)
        slopes = score.get("alibi_slopes")
        refs = []
        for b, (nq, nk) in enumerate(zip(lq, lk)):
            per = dict(score, alibi_slopes=slopes[b] if slopes is not None and slopes.dim() == 2 else slopes)
            refs.append(attention_reference(q[b:b + 1, :, :nq], k[b:b + 1, :, :nk], v[b:b + 1, :, :nk],
                                            is_causal=True, **per)[0].transpose(0, 1))
        return out, torch.cat(refs), (qp, kp, vp)
    raise AssertionError(entry)


ENTRIES = ["flash_attn", "flash_attn_func", "kvcache", "varlen", "varlen_attn"]


def _err(out, ref):
    return (out.double() - ref).abs().max().item()


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_point_takes_the_three_transforms(host_build, entry):
    g = torch.Generator().manual_seed(1)
    score = dict(softcap=4.0, alibi_slopes=torch.rand(2, HQ, generator=g) * 0.2,
                 sinks=torch.randn(HQ, generator=g) + 3)
    out, ref, _ = _call(entry, **score)
    assert _err(out, ref) <= TOL
    plain, plain_ref, _ = _call(entry)
    assert _err(plain, plain_ref) <= TOL and _err(out, plain_ref) > 10 * TOL  # the transforms did change it


BAD = [
    ({"softcap": -1.0}, InvalidArgumentError, "softcap must be 0.0 (no cap) or positive"),
    ({"softcap": float("nan")}, InvalidArgumentError, "softcap must be a finite number"),
    ({"softcap": True}, InvalidArgumentError, "softcap must be a finite number"),
    ({"softcap": "50"}, InvalidArgumentError, "softcap must be a finite number"),
    ({"softcap": 1e-45}, InvalidArgumentError, "softcap 1e-45 is outside float32's range"),
    ({"alibi_slopes": [0.5] * HQ}, InvalidArgumentError, "alibi_slopes must be a torch.Tensor or None"),
    ({"alibi_slopes": torch.ones(HQ, dtype=torch.float16)}, InvalidArgumentError, "alibi_slopes must be float32"),
    ({"alibi_slopes": torch.ones(HQ + 1)}, InvalidArgumentError, "alibi_slopes must be float32 [heads_q]"),
    ({"alibi_slopes": torch.ones(3, HQ)}, InvalidArgumentError, "or [batch, heads_q] = (2, 4)"),
    ({"alibi_slopes": torch.ones(2 * HQ)[::2]}, InvalidArgumentError, "alibi_slopes must be contiguous"),
    ({"alibi_slopes": torch.ones(HQ, device="meta")}, InvalidArgumentError, "alibi_slopes is on meta"),
    ({"alibi_slopes": torch.tensor([0.5, float("nan"), 0.1, 0.2])}, InvalidArgumentError,
     "alibi_slopes must hold finite values"),
    ({"sinks": torch.ones(HK)}, InvalidArgumentError, "sinks must be float32 [heads_q] = (4,)"),
    ({"sinks": torch.ones(HQ, dtype=torch.float64)}, InvalidArgumentError, "sinks must be float32"),
    ({"sinks": torch.tensor([0.0, float("inf"), 1.0, 2.0])}, InvalidArgumentError, "sinks must hold finite values"),
]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("score, error, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_transforms_are_typed_errors_naming_them(host_build, entry, score, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _call(entry, **score)


@pytest.mark.parametrize("entry", ENTRIES)
def test_sinks_that_require_grad_are_served_only_where_the_entry_has_a_backward(host_build, entry):
    """flash_attn, flash_attn_func and the packed entries give learned sinks their gradient (autograd
    records the call); the cache entry has no backward, so it refuses such sinks (never a silently
    missing gradient)."""
    sinks = torch.ones(HQ, requires_grad=True)
    if entry != "kvcache":
        out, ref, _ = _call(entry, sinks=sinks)
        assert out.requires_grad and _err(out.detach(), ref.detach()) <= TOL
    else:
        with pytest.raises(UnsupportedError, match="sinks requires grad"):
            _call(entry, sinks=sinks)


def test_a_refused_cache_append_leaves_the_cache_as_it_was(host_build):
    q, k, v = _qkv()
    kc, vc = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    k_before, v_before = kc.clone(), vc.clone()
    lengths = torch.tensor([10, 30], dtype=torch.int32)
    for score in ({"sinks": torch.tensor([0.0, float("nan"), 1.0, 2.0])}, {"softcap": -3.0},
                  {"alibi_slopes": torch.ones(5)}):
        with pytest.raises(InvalidArgumentError):
            rdnattention.flash_attn_with_kvcache(q[:, :, :1].transpose(1, 2).contiguous(), kc, vc, kc[:, :1] + 1,
                                                 vc[:, :1] + 1, cache_seqlens=lengths, **score)
        assert torch.equal(kc, k_before) and torch.equal(vc, v_before)


@pytest.mark.parametrize("entry", ENTRIES)
def test_replayed_calls_are_keyed_on_the_transforms(host_build, monkeypatch, entry):
    """One geometry with other transforms is another key: each call's result is its own options'."""
    monkeypatch.setattr(replay, "cache", {})
    g = torch.Generator().manual_seed(2)
    variants = [{}, {"softcap": 3.0}, {"softcap": 6.0}, {"softcap": 6}, {"sinks": torch.randn(HQ, generator=g) + 2},
                {"alibi_slopes": torch.rand(HQ, generator=g)}, {"alibi_slopes": torch.rand(2, HQ, generator=g)}]
    for score in variants + variants:  # each twice: the second time replayed
        out, ref, _ = _call(entry, **score)
        assert _err(out, ref) <= TOL, score
    assert len(replay.cache) == len(variants)


@pytest.mark.parametrize("entry", ["flash_attn", "kvcache", "varlen"])
def test_a_replayed_call_reads_its_own_sinks_and_slopes(host_build, monkeypatch, entry):
    """Values differ between calls of one key: each call's own are read (and checked)."""
    monkeypatch.setattr(replay, "cache", {})
    for seed in (3, 4):
        g = torch.Generator().manual_seed(seed)
        out, ref, _ = _call(entry, seed, sinks=torch.randn(HQ, generator=g) * 3,
                            alibi_slopes=torch.rand(2, HQ, generator=g))
        assert _err(out, ref) <= TOL
    assert len(replay.cache) == 1
    with pytest.raises(InvalidArgumentError, match="sinks must hold finite values"):
        _call(entry, sinks=torch.tensor([1.0, 2.0, float("-inf"), 0.0]), alibi_slopes=torch.rand(2, HQ))


@pytest.mark.parametrize("option, name", [(Option.SOFTCAP, "softcap"), (Option.ALIBI, "alibi_slopes"),
                                          (Option.SINKS, "sinks")])
@pytest.mark.parametrize("rows", [1, 64])
def test_the_int8_kernels_refuse_the_transforms_by_name(host_build, option, name, rows):
    table = route.device_table(torch.device("cpu"))
    request = Request(precision=Precision.INT8, layout=Layout.STRIDED, head_dim=64, rows=rows,
                      options=frozenset({option}))
    with pytest.raises(UnsupportedError, match=f"take no .*{name}"):
        route.choose(table, request)


@pytest.mark.parametrize("name, value", [("softcap", 30.0), ("alibi_slopes", torch.rand(HQ)), ("sinks", torch.randn(HQ))])
def test_a_transform_beyond_the_built_head_dims_is_refused_by_head_dim(host_build, name, value):
    """Above head_dim 256 neither the score-option kernels nor the split-KV kernels are built: the
    call is refused naming the head_dim, before anything runs."""
    table = route.device_table(torch.device("cpu"))
    d = 288
    assert d in table.head_dims("f16") and d not in table.head_dims("dec")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, HQ if i == 0 else HK, 40, d, generator=g).half() for i in range(3))
    before = [t.clone() for t in (q, k, v)]
    with pytest.raises(UnsupportedError, match=f"head_dim {d}"):
        rdnattention.flash_attn(q, k, v, is_causal=True, **{name: value})
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))


def test_the_custom_op_takes_the_transforms(host_build):
    q, k, v = _qkv()
    op = torch.ops.rdnattention.flash_attn_fwd.default
    slopes, sinks = torch.rand(2, HQ), torch.randn(HQ)
    args = (q, k, v, None, None, -1, 0, 0.125, False, True, False, None, 5.0, slopes, sinks)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    out, lse = op(*args)
    ref, ref_lse = attention_reference(q, k, v, is_causal=True, softmax_scale=0.125, softcap=5.0,
                                       alibi_slopes=slopes, sinks=sinks, return_lse=True)
    assert _err(out, ref) <= TOL and _err(lse, ref_lse) <= TOL


def test_compiled_calls_take_the_transforms(host_build):
    q, k, v = _qkv()
    sinks = torch.randn(HQ)
    fn = torch.compile(lambda q, k, v, s: rdnattention.flash_attn(q, k, v, is_causal=True, softcap=5.0, sinks=s),
                       fullgraph=True, backend="eager")
    ref = attention_reference(q, k, v, is_causal=True, softcap=5.0, sinks=sinks)
    assert _err(fn(q, k, v, sinks), ref) <= TOL


@pytest.mark.parametrize("target", ["gfx1030", "gfx906", "sm_90", "sm_61", "host", "host_f32"])
def test_the_decode_kernels_and_the_planner_agree_on_alibi_tiles(matrix, target):
    """The prelude a target's kernels are compiled with says what variants.yaml's decode_alibi_rows
    and decode_xf_cases say (the dispatch table's copy: test_alibi_calls_take_the_tiles_that_apply_it)."""
    from rdnattention_gen import render

    t = matrix.target(target)
    prelude = render.render_prelude(render.environment(), t)
    assert f"#define FA2_DECODE_ALIBI_ROWS {t.decode_alibi_rows}\n" in prelude
    assert f"#define FA2_DECODE_XF_CASES {int(t.decode_xf_cases)}\n" in prelude
    # AMD and Pascal keep their four-row tiles without ALiBi (a wave), sm_90 and host_f32 take it
    assert t.decode_alibi_rows == (4 if target in ("sm_90", "host_f32") else 2)


@pytest.mark.parametrize("target, plain, alibi", [("gfx1030", 4, 1), ("host_f32", 4, 4)])
def test_alibi_calls_take_the_tiles_that_apply_it(default_audit, host_build, build_dir, monkeypatch, target, plain,
                                                  alibi):
    """An ALiBi decode of eight rows per K/V head takes the largest tile that applies ALiBi: on AMD
    targets one of at most two rows (gfx1030 builds none of two at head_dim 64: its one-row tile, in
    eight row chunks), on sm_90's configuration the four-row tile plain calls take."""
    from rdnattention import dispatch
    from rdnattention.families import _splitkv

    monkeypatch.setattr(dispatch, "search_path", lambda: [build_dir])
    dispatch.table_for.cache_clear()
    try:
        table = dispatch.table_for(target)
        assert _splitkv.alibi_rows(table) == (2 if target == "gfx1030" else 4)
        assert _splitkv.select(table, "dec", D, 8).br == plain
        assert _splitkv.select(table, "dec", D, 8, most_rows=_splitkv.alibi_rows(table)).br == alibi
    finally:
        dispatch.table_for.cache_clear()


@pytest.mark.parametrize("rows", [1, 2, 8])  # GQA 8 (one row per query head of a group), decode
def test_alibi_decode_runs_tiles_that_apply_it(host_build, monkeypatch, rows):
    from rdnattention.families import _splitkv

    planned = []
    plan = route.plan
    monkeypatch.setattr(route, "plan", lambda table, call: planned.append((table, plan(table, call))) or planned[-1][1])
    monkeypatch.setattr(replay, "cache", {})
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(2, rows, 1, D, generator=g).half()
    k, v = (torch.randn(2, 1, 300, D, generator=g).half() for _ in range(2))
    slopes = torch.rand(rows, generator=g)
    out = rdnattention.flash_attn(q, k, v, alibi_slopes=slopes)
    assert _err(out, attention_reference(q, k, v, alibi_slopes=slopes)) <= TOL
    dec = [(t, launch.kernel) for t, p in planned for launch in p.launches if launch.kernel.family == "dec"]
    assert dec and all(e.br <= _splitkv.alibi_rows(t) for t, e in dec)
