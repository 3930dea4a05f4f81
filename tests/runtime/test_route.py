"""The chooser (rdnattention/route.py): which kernel family and layout serve a call, or why none do. Tables
made in code, so the preference is pinned apart from what a target happens to build."""

import pytest
import torch
from conftest import REPO_ROOT

import rdnattention
from rdnattention import plan_flash_attn, route
from rdnattention.errors import UnsupportedError
from rdnattention.route import Layout, Option, Precision, Request
from rdnattention.table import Constraints, KernelEntry, TargetTable


def _entry(family, head_dim=64, layout=None):
    return KernelEntry(name=f"{family}{layout or ''}_{head_dim}", family=family, head_dim=head_dim, gqa_group=1,
                       tier="x", threads=128, br=64, bc=32, tm=4, lds_bytes=0, priority=0, when=Constraints(),
                       provenance="test", args_digest="x", layout=layout)


TABLE = TargetTable("t", "host", REPO_ROOT, False, tuple(
    _entry(f, layout=layout) for f, layout in (("f16", None), ("f16", "len"), ("f16", "varlen"), ("dec", None),
                                              ("dec", "paged"), ("i8", None), ("i8dec", None)))
    + (_entry("f16", 96),))


def _choose(layout=Layout.STRIDED, rows=1, options=(), kernel=None, precision=Precision.FP16, head_dim=64,
            table=TABLE):
    return route.choose(table, Request(precision=precision, layout=layout, head_dim=head_dim, rows=rows,
                                       options=frozenset(options), kernel=kernel))


@pytest.mark.parametrize("layout, rows, options, family, compiled", [
    (Layout.STRIDED, 1, (), "dec", None),
    (Layout.STRIDED, route.SPLIT_KV_MAX_ROWS, (), "dec", None),
    (Layout.STRIDED, route.SPLIT_KV_MAX_ROWS + 1, (), "f16", None),
    (Layout.STRIDED, 1, (Option.ROTARY,), "f16", None),       # the row-block kernels rotate
    (Layout.STRIDED, 1, (Option.ROW_ORDER,), "f16", None),    # a row order asks for row blocks
    (Layout.SEQUSED, 1, (), "dec", None),                     # the split-KV kernels read lengths as they are
    (Layout.SEQUSED, 64, (), "f16", "len"),
    (Layout.SEQUSED, 64, (Option.KEY_SLICES,), "dec", None),  # flash_attn_with_kvcache's num_splits
    (Layout.SEQUSED, 64, (Option.CACHE_ROWS,), "dec", None),
    (Layout.PACKED, 4, (), "dec", None),
    (Layout.PACKED, 64, (), "f16", "varlen"),
    (Layout.PACKED, 64, (Option.QUERY_COUNTS,), "dec", None),  # padded batches (transformers)
    (Layout.PAGED, 64, (), "dec", "paged"),
])
def test_rows_layout_and_options_choose_the_family_and_layout(layout, rows, options, family, compiled):
    route_ = _choose(layout, rows, options)
    assert (route_.family, route_.layout) == (family, compiled)


def test_int8_and_a_head_dim_one_algorithm_lacks():
    assert _choose(rows=1, precision=Precision.INT8).family == "i8dec"
    assert _choose(rows=100, precision=Precision.INT8).family == "i8"
    assert _choose(rows=1, head_dim=96).family == "f16"  # no split-KV kernel at 96: the row-block one


def test_what_serves_nothing_says_why():
    with pytest.raises(UnsupportedError, match=r"^no f16 kernel for head_dim 80 on t; built head_dims: \[64, 96\]; "
                                               r"nor a dec kernel \(built head_dims: \[64\]\)$"):
        _choose(rows=100, head_dim=80)
    with pytest.raises(UnsupportedError, match=r"^no f16 len kernel for head_dim 96 on t; built head_dims: \[64\]; "
                                               r"nor a dec kernel \(built head_dims: \[64\]\)$"):
        _choose(Layout.SEQUSED, rows=100, head_dim=96)
    with pytest.raises(UnsupportedError, match=r"^no int8 kernels read a paged cache \(block_table\)$"):
        _choose(Layout.PAGED, precision=Precision.INT8)
    with pytest.raises(UnsupportedError, match=r"the fp16 row-block kernels \(f16\) take no cache rows chosen per "
                                               r"sequence \(cache_batch_idx\); the fp16 split-KV kernels \(dec\) take "
                                               r"no RoPE in the kernel"):
        _choose(options=(Option.ROTARY, Option.CACHE_ROWS))
    fp16_only = TargetTable("t", "host", REPO_ROOT, False, tuple(e for e in TABLE.kernels if e.family != "i8"))
    with pytest.raises(UnsupportedError, match="target t has no int8 kernels"):
        _choose(precision=Precision.INT8, table=fp16_only)


def test_a_forced_kernel_runs_where_its_family_serves_the_call():
    assert _choose(rows=100, kernel="dec_64").family == "dec"
    assert _choose(rows=1, kernel="f16_64").family == "f16"
    forced = _choose(Layout.PAGED, rows=1, kernel="decpaged_64")
    assert (forced.family, forced.layout) == ("dec", "paged")
    with pytest.raises(UnsupportedError, match=r"^kernel 'dec_64' does not serve this call on t: the dec kernels "
                                               r"take no RoPE in the kernel \(rotary_cos, rotary_sin\)$"):
        _choose(options=(Option.ROTARY,), kernel="dec_64")
    with pytest.raises(UnsupportedError, match=r"^kernel 'f16len_64' does not serve this call on t: it is a f16 len "
                                               r"kernel; this fp16 call with strided keys and values runs the f16, dec "
                                               r"kernels$"):
        _choose(kernel="f16len_64")
    with pytest.raises(UnsupportedError, match="kernel 'nope' does not serve this call on t: no kernel of that name"):
        _choose(kernel="nope")


def test_a_call_describes_itself():
    meta = dict(dtype=torch.float16, device="meta")
    q, k = torch.empty(2, 8, 3, 64, **meta), torch.empty(2, 2, 50, 64, **meta)
    call = route.Attention(q=q, k=k, v=k, out=q, lse=None, window=(-1, 0), softmax_scale=1.0, batch=2, seq_q=3,
                           seq_k=50, seqused_k=torch.empty(2, dtype=torch.int32, device="meta"), num_splits=2)
    assert call.request() == Request(precision=Precision.FP16, layout=Layout.SEQUSED, head_dim=64, rows=12,
                                     options=frozenset({Option.KEY_SLICES}), seq_q=3)
    packed = route.Attention(q=q, k=k, v=k, out=q, lse=None, window=(-1, -1), softmax_scale=1.0, batch=2, seq_q=3,
                             seq_k=50, cu_seqlens_q=k, cu_seqlens_k=k, num_splits=2)
    assert packed.request().layout is Layout.PACKED and not packed.request().options  # slices where split-KV runs


def test_a_forced_split_kv_kernel_with_rope_is_refused(host_build):
    """It used to run without the rotation; the split-KV kernels have none."""
    q = torch.randn(1, 2, 1, 64).half()
    k = torch.randn(1, 2, 40, 64).half()
    cos, sin = torch.ones(40, 16), torch.zeros(40, 16)
    name = next(e.name for e in route.device_table(q.device).kernels
                if e.family == "dec" and e.head_dim == 64 and e.dtype is None)
    with pytest.raises(UnsupportedError, match="the dec kernels take no RoPE in the kernel"):
        plan_flash_attn(q, k, k, rotary_cos=cos, rotary_sin=sin, kernel=name)


def _bf16(family, head_dim=64, layout=None):
    e = _entry(family, head_dim, layout)
    return KernelEntry(**{**e.__dict__, "name": e.name + "_bf16", "dtype": "bf16"})


# bf16 kernels (the fp16 families' dtype option) at head_dim 64 only, paged decode among them.
BF16_TABLE = TargetTable("t", "host", REPO_ROOT, False, TABLE.kernels + tuple(
    _bf16(f, layout=layout) for f, layout in (("f16", None), ("dec", None), ("dec", "paged"))))


def test_a_call_runs_the_kernels_of_its_dtype():
    for dtype in (None, "bf16"):
        for layout, rows, family, compiled in ((Layout.STRIDED, 1, "dec", None), (Layout.STRIDED, 64, "f16", None),
                                               (Layout.PAGED, 64, "dec", "paged")):
            r = route.choose(BF16_TABLE, Request(precision=Precision.FP16, layout=layout, head_dim=64, rows=rows,
                                                 dtype=dtype))
            assert (r.family, r.layout, r.dtype) == (family, compiled, dtype)
            assert BF16_TABLE.select(r.family, layout=r.layout, dtype=r.dtype, head_dim=64, heads_per_kv=1,
                                     causal=False, seq_q=rows).dtype == dtype


def test_a_dtype_without_kernels_is_refused_naming_it():
    # bf16 at 96: built in fp16 only
    with pytest.raises(UnsupportedError, match=r"no f16 bf16 kernel for head_dim 96 on t; built head_dims: \[64\]; "
                                               r"nor a dec bf16 kernel \(built head_dims: \[64\]\)"):
        route.choose(BF16_TABLE, Request(precision=Precision.FP16, layout=Layout.STRIDED, head_dim=96, rows=64,
                                         dtype="bf16"))
    # No f16 varlen bf16 kernel here: a long packed bf16 batch takes the split-KV ones, which read it.
    assert route.choose(BF16_TABLE, Request(precision=Precision.FP16, layout=Layout.PACKED, head_dim=64, rows=64,
                                            dtype="bf16")).family == "dec"
    # A bf16 kernel forced by name does not serve an fp16 call, nor an fp16 one a bf16 call.
    with pytest.raises(UnsupportedError, match="it is a f16 bf16 kernel; this fp16 call"):
        route.choose(BF16_TABLE, Request(precision=Precision.FP16, layout=Layout.STRIDED, head_dim=64, rows=64,
                                         kernel="f16_64_bf16"))
    with pytest.raises(UnsupportedError, match="it is a f16 kernel; this bf16 call .* runs the f16 bf16, dec bf16"):
        route.choose(BF16_TABLE, Request(precision=Precision.FP16, layout=Layout.STRIDED, head_dim=64, rows=64,
                                         kernel="f16_64", dtype="bf16"))


def test_bf16_tensors_at_a_head_dim_without_bf16_kernels_are_refused_untouched(host_build):
    q = torch.randn(1, 2, 8, 32).bfloat16()  # fp16 kernels at 32, bf16 ones from 64
    saved = q.clone()
    with pytest.raises(UnsupportedError, match="bf16 kernel for head_dim 32"):
        rdnattention.flash_attn(q, q, q)
    assert torch.equal(q, saved)


def _alibi(family, head_dim=64, layout=None, dtype=None):
    e = _entry(family, head_dim, layout)
    return KernelEntry(**{**e.__dict__, "name": e.name + (dtype or "") + "_alibi", "dtype": dtype, "score": "alibi"})


# Row-block kernels of score option alibi at head_dim 64 (plain, len and bf16, no varlen), none at 96.
ALIBI_TABLE = TargetTable("t", "host", REPO_ROOT, False, BF16_TABLE.kernels + tuple(
    _alibi("f16", layout=layout, dtype=dtype) for layout, dtype in ((None, None), ("len", None), (None, "bf16"))))


@pytest.mark.parametrize("layout, rows, seq_q, dtype, family, compiled, score", [
    # Many query rows: the row-block kernels compiled with ALiBi, of the call's layout and dtype.
    (Layout.STRIDED, 64, 64, None, "f16", None, "alibi"),
    (Layout.STRIDED, route.SPLIT_KV_MAX_ROWS + 1, None, None, "f16", None, "alibi"),
    (Layout.SEQUSED, 64, 64, None, "f16", "len", "alibi"),
    (Layout.STRIDED, 64, 64, "bf16", "f16", None, "alibi"),
    # Few rows (split_kv_preferred): the split-KV kernels, as without ALiBi.
    (Layout.STRIDED, 1, 1, None, "dec", None, None),
    (Layout.STRIDED, route.SPLIT_KV_MAX_ROWS, None, None, "dec", None, None),
    (Layout.STRIDED, 64, route.SPLIT_KV_MAX_SEQ_Q, None, "dec", None, None),  # GQA 4, 16 rows per sequence
    # No alibi kernel of the call's layout (varlen) built: the split-KV kernels serve any rows.
    (Layout.PACKED, 64, 64, None, "dec", None, None),
])
def test_alibi_calls_of_many_rows_run_the_row_block_alibi_kernels(layout, rows, seq_q, dtype, family, compiled, score):
    r = route.choose(ALIBI_TABLE, Request(precision=Precision.FP16, layout=layout, head_dim=64, rows=rows,
                                          options=frozenset({Option.ALIBI}), seq_q=seq_q, dtype=dtype))
    assert (r.family, r.layout, r.dtype, r.score) == (family, compiled, dtype, score)
    if score:
        entry = ALIBI_TABLE.select(r.family, layout=r.layout, dtype=r.dtype, score=r.score, head_dim=64, heads_per_kv=1,
                                   causal=False, seq_q=rows)
        assert (entry.score, entry.dtype, entry.layout) == ("alibi", dtype, compiled)


def test_calls_without_alibi_never_run_the_alibi_kernels():
    for layout, rows in ((Layout.STRIDED, 64), (Layout.SEQUSED, 64), (Layout.STRIDED, 1)):
        r = route.choose(ALIBI_TABLE, Request(precision=Precision.FP16, layout=layout, head_dim=64, rows=rows,
                                              options=frozenset({Option.SOFTCAP, Option.SINKS})))
        assert r.score is None
        assert ALIBI_TABLE.select(r.family, layout=r.layout, score=r.score, head_dim=64, heads_per_kv=1, causal=False,
                                  seq_q=rows).score is None
    with pytest.raises(UnsupportedError, match="it is a f16 alibi kernel; this fp16 call .* runs the f16, dec kernels"):
        _choose(rows=64, kernel="f16_64_alibi", table=ALIBI_TABLE)
    # and an ALiBi call names an alibi kernel or a split-KV one
    assert _choose(rows=64, options=(Option.ALIBI,), kernel="f16_64_alibi", table=ALIBI_TABLE).score == "alibi"
    with pytest.raises(UnsupportedError, match="it is a f16 kernel; this fp16 call .* runs the f16 alibi, dec kernels"):
        _choose(rows=64, options=(Option.ALIBI,), kernel="f16_64", table=ALIBI_TABLE)


def test_alibi_at_a_head_dim_without_alibi_kernels_runs_split_kv_or_says_why():
    # f16 is built at 96 without ALiBi, dec not at all: nothing applies ALiBi there
    with pytest.raises(UnsupportedError, match=r"^no f16 alibi kernel for head_dim 96 on t; built head_dims: \[64\]; "
                                               r"nor a dec kernel \(built head_dims: \[64\]\)$"):
        _choose(rows=64, options=(Option.ALIBI,), head_dim=96, table=ALIBI_TABLE)
    with_dec = TargetTable("t", "host", REPO_ROOT, False, ALIBI_TABLE.kernels + (_entry("dec", 96),))
    assert _choose(rows=64, options=(Option.ALIBI,), head_dim=96, table=with_dec).family == "dec"
