"""Split-KV decode (the dec family and its paged kernels, several key slices merged in the same launch) on
the host platform, against the float64 oracle: key slices, cache lengths, GQA, windows, causal masks, paged caches and packed batches. Paged
and contiguous calls of the same keys, and one slice against several, run the same arithmetic per
slice, so they are compared exactly where the math is the same."""

import itertools
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import BF16_LSE_TOL, BF16_TOL, mirrored_kernels
from rdnattention import attention_reference, dispatch, drivers, plan_flash_attn
from rdnattention.errors import UnsupportedError
from rdnattention.families import dec
from rdnattention.table import TargetTable
from rdnattention_gen.families import spec_from_name

TOL = 2e-3


DEVICE = torch.device("cpu")


@pytest.fixture(scope="module", params=["host", "host_f32", pytest.param("cuda", marks=pytest.mark.gpu)])
def table(request, monkeypatch_module):
    """The table of the platform under test; tensors are made on its device (DEVICE)."""
    global DEVICE
    if request.param == "cuda":
        if not torch.cuda.is_available() or torch.version.hip is not None:
            pytest.skip("needs an NVIDIA GPU")
        DEVICE = torch.device("cuda")
    else:
        request.getfixturevalue("host_build")
        monkeypatch_module.setenv("RDNATTENTION_HOST_TARGET", request.param)
        DEVICE = torch.device("cpu")
    yield dispatch.table_for(drivers.target_of(DEVICE))
    DEVICE = torch.device("cpu")


def _on(*ts):
    return tuple(None if t is None else t.to(DEVICE) for t in ts)


def _inputs(b, hq, hk, sq, sk, d, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return _on(torch.randn(b, hq, sq, d, generator=g).to(dtype), torch.randn(b, hk, sk, d, generator=g).to(dtype),
               torch.randn(b, hk, sk, d, generator=g).to(dtype))


def _window(options):
    left, right = options.get("window_size", (-1, -1))
    if options.get("is_causal"):
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _call(q, k, v, options, **extra):
    b, hq, sq, d = q.shape
    fields = dict(q=q, k=k, v=v, out=torch.empty_like(q), lse=torch.empty(b, hq, sq, device=q.device),
                  window=_window(options),
                  softmax_scale=d ** -0.5, batch=b, seq_q=sq, seq_k=k.shape[2])
    fields.update(extra)
    return dec.Call(**fields)


def _run(table, call):
    plan = dec.plan(table, call)
    plan.run()
    plan.outputs = tuple(None if t is None else t.cpu() for t in plan.outputs)
    return plan


def _check(out, lse, ref, ref_lse, tol=TOL, lse_tol=TOL):
    """``tol``, ``lse_tol``: the output's and the LSE's (bf16: BF16_TOL and BF16_LSE_TOL, tests/cases.py)."""
    assert (out.double() - ref).abs().max().item() <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    if finite.any():
        assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= lse_tol


CASES = [  # (batch, heads_q, heads_kv, seq_q, seq_k, head_dim, options)
    (1, 4, 4, 1, 300, 128, {}),
    (2, 8, 2, 1, 257, 64, {"is_causal": True}),
    (1, 4, 1, 1, 200, 256, {"window_size": (50, -1)}),
    (2, 4, 2, 2, 190, 128, {"is_causal": True}),      # 4 rows per K/V head: one chunk
    (1, 6, 2, 3, 150, 64, {"window_size": (20, 0)}),  # 9 rows: three chunks of the 4-row kernel
    (1, 2, 2, 4, 120, 128, {"window_size": (16, 3)}),
    (1, 2, 1, 17, 97, 64, {"is_causal": True}),       # a short prefill through the decode kernel
]


@pytest.mark.parametrize("splits", [1, 3, 21, 0])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + "-" + str(c[6]))
def test_matches_the_oracle(table, case, splits):
    b, hq, hk, sq, sk, d, options = case
    q, k, v = _inputs(b, hq, hk, sq, sk, d)
    plan = _run(table, _call(q, k, v, options, num_splits=splits))
    assert plan.launches[0].kernel.family == "dec"
    assert len(plan.launches) == 1  # several slices merge in the same launch
    assert (plan.counters > 0) == (plan.scratch_bytes > 0) == (plan.launches[0].args.splits > 1)
    if plan.counters:  # the last slice of each row chunk reset its counter: the next launch finds them zero
        assert not plan.buffers[-1].any()
    if splits:
        assert plan.launches[0].args.splits == dec.slices(sk, plan.launches[0].kernel.bc, splits)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    _check(*plan.outputs, ref, ref_lse)


@pytest.mark.parametrize("splits", [1, 3, 0])
@pytest.mark.parametrize("case", [c for c in CASES if c[5] in (64, 128, 256)],
                         ids=lambda c: "x".join(map(str, c[:6])) + "-" + str(c[6]))
def test_bf16_matches_the_oracle(table, case, splits):
    """The bf16 decode kernels (their slices merged) on bf16 inputs: bf16 out, within BF16_TOL."""
    b, hq, hk, sq, sk, d, options = case
    q, k, v = _inputs(b, hq, hk, sq, sk, d, dtype=torch.bfloat16)
    plan = _run(table, _call(q, k, v, options, num_splits=splits))
    assert all(launch.kernel.dtype == "bf16" for launch in plan.launches)
    assert plan.launches[0].kernel.family == "dec" and plan.outputs[0].dtype == torch.bfloat16
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    _check(*plan.outputs, ref, ref_lse, tol=BF16_TOL, lse_tol=BF16_LSE_TOL)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("lengths", [[300, 1, 77], [0, 5, 300]])
def test_cache_lengths(table, lengths, splits):
    q, k, v = _inputs(3, 4, 2, 1, 300, 128)
    seqused, = _on(torch.tensor(lengths, dtype=torch.int32))
    plan = _run(table, _call(q, k, v, {}, seqused_k=seqused, num_splits=splits))
    ref, ref_lse = attention_reference(q, k, v, seqused_k=seqused.cpu(), return_lse=True)
    _check(*plan.outputs, ref, ref_lse)
    if lengths[0] == 0:  # no key: a zero row
        assert plan.outputs[0][0].abs().max() == 0


def _paged(t, page, order):
    """[b, hk, sk, d] as a [pages, page, hk, d] cache in the page order ``order``, viewed [pages, hk, page, d]."""
    b, hk, sk, d = t.shape
    cache = torch.zeros(len(order), page, hk, d, dtype=t.dtype, device=t.device)
    cache[order.long().to(t.device)] = t.transpose(1, 2).reshape(b * sk // page, page, hk, d)
    return cache.transpose(1, 2)


@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"window_size": (40, 0)}])
def test_paged_is_contiguous_bit_for_bit(table, page, splits, options):
    b, sk = 2, 512
    q, k, v = _inputs(b, 4, 2, 2, sk, 64)
    order = torch.randperm(b * sk // page, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    block_table, seqused = _on(order.view(b, sk // page), torch.tensor([sk, 300], dtype=torch.int32))
    contiguous = _run(table, _call(q, k, v, options, seqused_k=seqused, num_splits=splits))
    paged = _run(table, _call(q, _paged(k, page, order), _paged(v, page, order), options, seqused_k=seqused,
                              block_table=block_table, seq_k=sk, num_splits=splits))
    assert (paged.launches[0].kernel.family, paged.launches[0].kernel.layout) == ("dec", "paged")
    assert torch.equal(paged.outputs[0], contiguous.outputs[0])
    assert torch.equal(paged.outputs[1], contiguous.outputs[1])
    ref, ref_lse = attention_reference(q, k, v, seqused_k=seqused.cpu(), return_lse=True, **options)
    _check(*paged.outputs, ref, ref_lse)


@pytest.mark.parametrize("splits", [1, 2])
def test_packed_batches(table, splits):
    """Packed queries and keys (cu_seqlens): each sequence against its own keys only."""
    lengths_q, lengths_k = [1, 3, 2], [40, 100, 7]
    hq, hk, d = 4, 2, 64
    g = torch.Generator().manual_seed(2)
    q, k, v, cu_q, cu_k = _on(torch.randn(sum(lengths_q), hq, d, generator=g).half(),
                              torch.randn(sum(lengths_k), hk, d, generator=g).half(),
                              torch.randn(sum(lengths_k), hk, d, generator=g).half(),
                              torch.tensor([0, 1, 4, 6], dtype=torch.int32),
                              torch.tensor([0, 40, 140, 147], dtype=torch.int32))
    out, lse = torch.empty_like(q), torch.empty(hq, sum(lengths_q), device=q.device)
    view = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731  [1, heads, total, d]
    call = dec.Call(q=view(q), k=view(k), v=view(v), out=view(out), lse=lse, window=(-1, 0), softmax_scale=d ** -0.5,
                    batch=3, seq_q=max(lengths_q), seq_k=max(lengths_k), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    num_splits=splits)
    _run(table, call)
    q, k, v, out, lse, cu_q, cu_k = (t.cpu() for t in (q, k, v, out, lse, cu_q, cu_k))
    for i in range(3):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        ref, ref_lse = attention_reference(view(q[qs]), view(k[ks]), view(v[ks]), is_causal=True, return_lse=True)
        _check(view(out[qs]), lse[:, qs].unsqueeze(0), ref, ref_lse)


def test_nan_scores_make_their_rows_nan(table):
    q, k, v = _inputs(1, 2, 2, 1, 200, 64)
    k[0, 1, 150, 0] = float("nan")
    plan = _run(table, _call(q, k, v, {}, num_splits=4))
    out, lse = plan.outputs
    assert torch.isnan(out[0, 1]).all() and torch.isnan(lse[0, 1]).all()
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(lse[0, 0]).all()


def test_one_slice_or_several_agree(table):
    q, k, v = _inputs(1, 4, 4, 1, 1000, 128)
    one = _run(table, _call(q, k, v, {}, num_splits=1)).outputs[0]
    several = _run(table, _call(q, k, v, {}, num_splits=8)).outputs[0]
    assert (one.double() - several.double()).abs().max() <= TOL


def test_flash_attn_routes_few_rows_to_decode(table):
    q, k, v = _inputs(1, 8, 2, 1, 100, 64)
    assert plan_flash_attn(q, k, v).launches[0].kernel.family == "dec"
    q, k, v = _inputs(1, 8, 2, 64, 100, 64)  # 256 rows per K/V head: the row-block kernel
    assert plan_flash_attn(q, k, v).launches[0].kernel.family == "f16"
    cos_sin = _on(torch.ones(100, 8), torch.zeros(100, 8))
    q, k, v = _inputs(1, 8, 2, 1, 100, 64)  # RoPE in the kernel: the row-block kernels rotate
    assert plan_flash_attn(q, k, v, rotary_cos=cos_sin[0], rotary_sin=cos_sin[1]).launches[0].kernel.family == "f16"


def test_automatic_slices_fill_the_device():
    # 4 workgroups per unit over 32 workgroups: 16 slices (one wave of 528); 9 over 64 would start a second.
    assert dec.splits_for(workgroups=32, seq_k=8192, keys_per_step=32, units=132, per_unit=4) == 16
    assert dec.splits_for(workgroups=32, seq_k=8192, keys_per_step=32, units=132, per_unit=6) == 24
    assert dec.splits_for(workgroups=4096, seq_k=8192, keys_per_step=32, units=132, per_unit=4) == 1
    assert dec.splits_for(workgroups=64, seq_k=8192, keys_per_step=16, units=132, per_unit=4) == 8
    assert dec.splits_for(workgroups=1, seq_k=100, keys_per_step=32, units=132, per_unit=4) == 2  # two steps at least
    # Few workgroups over a short cache: slices of MIN_SLICE_KEYS keys, or one workgroup per unit
    # where that gives more (generate()'s decode steps: 8 workgroups, 132 units), not a wave of 528.
    assert dec.MIN_SLICE_KEYS == 128
    assert dec.splits_for(workgroups=8, seq_k=2048, keys_per_step=16, units=132, per_unit=4) == 16
    assert dec.splits_for(workgroups=8, seq_k=1024, keys_per_step=16, units=132, per_unit=4) == 16
    assert dec.splits_for(workgroups=2, seq_k=1024, keys_per_step=16, units=8, per_unit=4) == 8  # 128 keys each
    assert dec.splits_for(workgroups=8, seq_k=32768, keys_per_step=16, units=132, per_unit=4) == 64  # a wave again
    assert dec.slices(8192, 32, 17) == 16 and dec.slices(8192, 32, 16) == 16 and dec.slices(100, 32, 3) == 2 and dec.slices(0, 32, 5) == 1


def _slices_by_definition(seq_k, per_step, asked, workgroups, units, per_unit):
    """The planner's slice count as splits_for's and slices' docstrings state it: ``asked`` slices
    (at least 1), or where 0, enough to bring the workgroups up to one wave of ``per_unit`` per unit,
    no more than slices of MIN_SLICE_KEYS keys give unless one workgroup per unit asks for more, each
    slice at least two steps; then each slice rounded up to whole steps, and only the non-empty
    ones counted."""
    if asked:
        wanted = max(1, asked)
    else:
        wave = max(1, per_unit * units // max(workgroups, 1))
        enough = max(seq_k // dec.MIN_SLICE_KEYS, units // max(workgroups, 1))
        wanted = max(1, min(wave, enough, math.ceil(seq_k / (2 * per_step))))
    if not seq_k:
        return 1
    per = math.ceil(math.ceil(seq_k / wanted) / per_step) * per_step
    return max(1, math.ceil(seq_k / per))


@pytest.mark.parametrize("per_step", [4, 16, 64])
@pytest.mark.parametrize("asked", [-2, 0, 1, 3])
def test_the_slice_count_is_its_definition_at_every_length(per_step, asked):
    """splits_for and slices (the planner's count) and Lengths.splits (which a replay following a
    growing cache computes per new length) give the count their definition gives, at every length
    up to 1200 and at longer ones, on launches where each of its bounds decides (a wave, a workgroup
    per unit, slices of MIN_SLICE_KEYS, two steps a slice)."""
    from rdnattention.families._splitkv import Lengths
    for workgroups, units, per_unit in itertools.product([1, 3, 8, 64, 5000], [8, 60, 132], [3, 4]):
        lengths = Lengths(chunks=1, keys_per_step=per_step, workgroups=workgroups, units=units, per_unit=per_unit,
                          num_splits=asked, rows=1, head_dim=64)
        for seq_k in [*range(1200), *range(1200, 70000, 97)]:
            want = _slices_by_definition(seq_k, per_step, asked, workgroups, units, per_unit)
            planned = (dec.slices(seq_k, per_step, asked) if asked
                       else dec.splits_for(workgroups, seq_k, per_step, units, per_unit))
            assert lengths.splits(seq_k) == planned == want, (workgroups, units, per_unit, seq_k)


def test_resident_workgroups_match_the_audit(table):
    """The occupancy the automatic slice count fills: the runtime's count for each decode kernel on
    a GPU (one SM holds waves-per-SIMD x 4 schedulers' warps), the fixed count on the emulator."""
    audit = {k["name"]: k for k in json.loads((table.code_object.parent / "audit.json").read_text())["kernels"]}
    for entry in table.entries("dec", 128):
        got = dec.resident(table, entry, DEVICE)
        if DEVICE.type == "cpu":
            assert got == drivers.host.RESIDENT_WORKGROUPS
        else:
            warps = entry.threads // 32
            assert got == audit[entry.name]["waves_per_simd"] * 4 // warps, entry.name


def test_a_table_without_decode_kernels_says_so(table):
    bare = TargetTable(target=table.target, platform=table.platform, code_object=table.code_object,
                                dynamic_lds=table.dynamic_lds,
                                kernels=tuple(e for e in table.kernels if e.family != "dec"))
    q, k, v = _inputs(1, 2, 2, 1, 50, 64)
    with pytest.raises(UnsupportedError, match="no dec .*head_dim 64"):
        dec.plan(bare, _call(q, k, v, {}))


@st.composite
def _decode_calls(draw):
    return dict(head_dim=draw(st.sampled_from([64, 80, 128])), heads_kv=draw(st.integers(1, 2)),
                group=draw(st.integers(1, 3)), batch=draw(st.integers(1, 3)), seq_q=draw(st.integers(1, 5)),
                page=draw(st.sampled_from([16, 32, 64])), pages=draw(st.integers(1, 4)),
                splits=draw(st.integers(0, 24)), causal=draw(st.booleans()), left=draw(st.integers(-1, 40)),
                lengths_seed=draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(c=_decode_calls())
def test_any_combination_matches_the_oracle_and_paged_is_contiguous(host_build, c):
    """Random slices, cache lengths, GQA groups, windows, causal masks and page sizes (host target)."""
    table = dispatch.table_for("host")
    b, hk, d, page = c["batch"], c["heads_kv"], c["head_dim"], c["page"]
    sk = page * c["pages"]
    g = torch.Generator().manual_seed(c["lengths_seed"])
    q = torch.randn(b, hk * c["group"], c["seq_q"], d, generator=g).half()
    k, v = (torch.randn(b, hk, sk, d, generator=g).half() for _ in range(2))
    seqused = torch.randint(0, sk + 1, (b,), generator=g, dtype=torch.int32)
    options = {"is_causal": c["causal"], "window_size": (c["left"], -1)}
    order = torch.randperm(b * c["pages"], generator=g).to(torch.int32)
    contiguous = dec.plan(table, _call(q, k, v, options, seqused_k=seqused, num_splits=c["splits"]))
    paged = dec.plan(table, _call(q, _paged(k, page, order), _paged(v, page, order), options, seqused_k=seqused,
                                  block_table=order.view(b, c["pages"]), seq_k=sk, num_splits=c["splits"]))
    contiguous.run()
    paged.run()
    assert torch.equal(paged.outputs[0], contiguous.outputs[0]) and torch.equal(paged.outputs[1], contiguous.outputs[1])
    ref, ref_lse = attention_reference(q, k, v, seqused_k=seqused, return_lse=True, **options)
    _check(*contiguous.outputs, ref, ref_lse)


@pytest.mark.parametrize("target,name", mirrored_kernels(("dec",)))
def test_mirrored_gpu_decode_tiles_match_the_oracle(host_build, monkeypatch, target, name):
    """sm_90's tuned decode tiles (alternates of host_f32) through every oracle case, forced by name;
    the paged kernels on a paged copy of the same keys."""
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    table = dispatch.table_for(target)
    for b, hq, hk, sq, sk, d, options in CASES:
        if f"_hd{d}_" not in name:
            continue
        bf16 = spec_from_name(name).option("dtype") == "bf16"  # a bf16 kernel's tile runs on bf16 inputs
        q, k, v = _inputs(b, hq, hk, sq, sk, d, dtype=torch.bfloat16 if bf16 else torch.float16)
        for splits in (1, 3):
            call = _call(q, k, v, options, num_splits=splits)
            if spec_from_name(name).option("layout") == "paged":
                page = 16
                pages = -(-sk // page)
                pad = pages * page - sk
                kp, vp = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (k, v))
                order = torch.randperm(b * pages, generator=torch.Generator().manual_seed(0)).to(torch.int32)
                call = _call(q, _paged(kp, page, order), _paged(vp, page, order), options, num_splits=splits,
                             block_table=order.view(b, pages), seq_k=pages * page,
                             seqused_k=torch.full((b,), sk, dtype=torch.int32))
            plan = dec.plan(table, call, kernel=name)
            assert plan.launches[0].kernel.name == name
            plan.run()
            ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
            _check(*plan.outputs, ref, ref_lse, *((BF16_TOL, BF16_LSE_TOL) if bf16 else (TOL, TOL)))

