"""The generic oracle sweep on the host platform: every family of the matrix x every head_dim the
host targets build for it x every case the family declares x every dtype it is built for (fp16,
bf16: tests/cases.py), through the entry point that serves the family, against the float64 oracle,
checking that the family (and layout, dtype and score option) did run; then every case again (every family and
layout at its smallest head_dim; the plain fp16 kernels at every head_dim in the slow suite) with the emulator's fiber order shuffled at every sync
point, which must change nothing (a missing barrier would)."""

import pytest
import torch
from cases import (DTYPES, INT8_LSE_TOL, INT8_REL_RMS, TOLS, TORCH_DTYPES, forward_families, layout_of, run_case,
                   score_of, sweep, sweep_id)

import rdnattention
from rdnattention import kvcache, replay, route
from rdnattention.families import append, quant
from rdnattention_gen.families import family
from rdnattention_gen.matrix import load_matrix

SWEEP = sweep()
IDS = [sweep_id(p) for p in SWEEP]
# The in-order results of the sweep, for the shuffled run.
in_order_results = {}


def test_every_family_and_layout_declares_cases_and_is_swept():
    m = load_matrix()
    for name in forward_families(m):
        axes = m.kernels[name]
        assert family(name).oracle_cases, f"family {name} declares no oracle_cases"
        for layout in (None, *axes.get("layouts", {})):
            for dtype in ("fp16", *axes.get("dtypes", {})):
                for score in (None, *axes.get("scores", {})):
                    assert any(p[1] == name and layout_of(name, p[3]) == layout and p[4] == dtype
                               and score_of(name, p[3]) == score for p in SWEEP), \
                        f"no {name} case of layout {layout} and score option {score} in {dtype} is swept (none " \
                        "declared, or the host targets build none)"


@pytest.fixture
def families_run(monkeypatch):
    """The (family, layout, dtype, score option) of the kernels each call planned (route.plan), with
    the replay cache empty so that every call is planned."""
    ran = []
    plan = route.plan

    def recording(table, call):
        p = plan(table, call)
        ran.append({(launch.kernel.family, launch.kernel.layout, launch.kernel.dtype, launch.kernel.score)
                    for launch in p.launches})
        return p

    monkeypatch.setattr(route, "plan", recording)
    launch = append.launch  # flash_attn_with_kvcache's append: planned apart from route.plan

    def recording_append(table, **kwargs):
        first = launch(table, **kwargs)
        ran.append({(first.kernel.family, first.kernel.layout, first.kernel.dtype, first.kernel.score)})
        return first

    monkeypatch.setattr(append, "launch", recording_append)
    quantize = quant.launch  # the INT8 entry points' quantization: planned apart too

    def recording_quant(table, **kwargs):
        first = quantize(table, **kwargs)
        ran.append({(first.kernel.family, None, None, None)})
        return first

    monkeypatch.setattr(quant, "launch", recording_quant)
    monkeypatch.setattr(replay, "cache", {})
    return ran


FUSED = [p for p in SWEEP if p[1] == "append" and p[3] == "append"]


@pytest.mark.parametrize("target,fam,head_dim,case,dtype", FUSED, ids=[sweep_id(p) for p in FUSED])
def test_the_fused_append_matches_oracle(host_build, monkeypatch, families_run, target, fam, head_dim, case, dtype):
    """The append case without RoPE tables, appended by the split-KV decode's own launch
    (fa2_decode_append; kvcache.FUSE_MAX_NEW): no append kernel runs, the cache holds the torch
    append's bytes (tests/cases.py's _append checks them) and the output is the oracle's within the
    dtype's tolerance."""
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    out, lse, ref, ref_lse, _ = run_case(fam, case, head_dim, dtype)
    assert families_run and all(ran and all(r[0] == "dec" for r in ran) for ran in families_run), families_run
    tol, lse_tol = TOLS[dtype]
    assert (out.double() - ref).abs().max().item() <= tol
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and finite.any()
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= lse_tol


@pytest.mark.parametrize("target,fam,head_dim,case,dtype", SWEEP, ids=IDS)
def test_matches_oracle(host_build, monkeypatch, families_run, target, fam, head_dim, case, dtype):
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    if fam == "append":  # the append kernel's own launch, where the decode's launch would append (below)
        monkeypatch.setattr(kvcache, "FUSE_MAX_NEW", 0)
    out, lse, ref, ref_lse, int8 = run_case(fam, case, head_dim, dtype)
    want = (fam, layout_of(fam, case), DTYPES[dtype], score_of(fam, case))
    # A kvcache call with new keys runs the append kernel first, an INT8 call of fp16 inputs the quant
    # kernel: the other families' cases look at the attention launches, those two's at their own.
    before = ("append", "quant")
    runs = [ran for ran in families_run if any(r[0] in before for r in ran) == (fam in before)]
    assert runs and all(want in ran for ran in runs), \
        f"the call ran the kernels {families_run}, not {fam} of layout {want[1]} and score option {want[3]} " \
        f"in {dtype}"
    assert out.dtype == TORCH_DTYPES[dtype]  # the inputs' (int8: fp16)
    assert torch.isfinite(out).all()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    if int8:
        rel_rms = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel_rms <= INT8_REL_RMS, f"relative RMS error {rel_rms:.2e}"
        assert lse_err <= INT8_LSE_TOL, f"lse error {lse_err:.2e}"
    else:
        tol, lse_tol = TOLS[dtype]
        err = (out.double() - ref).abs().max().item()
        assert err <= tol, f"max abs error {err:.2e}"
        assert lse_err <= lse_tol, f"lse error {lse_err:.2e}"
    in_order_results[(target, fam, head_dim, case, dtype)] = (out, lse)


# Every family, layout and case at its smallest head_dim in the fast suite; the plain fp16 kernels at
# every other head_dim behind the slow marker (each runs its in-order case first when the in-order
# test did not run in the same session).
def _smallest(p):
    return p[2] == min(q[2] for q in SWEEP if q[:2] == p[:2] and q[3:] == p[3:])


SHUFFLED = [pytest.param(*p, id=sweep_id(p), marks=() if _smallest(p) else pytest.mark.slow)
            for p in SWEEP if _smallest(p) or (p[1] == "f16" and layout_of(p[1], p[3]) is None)]


@pytest.mark.parametrize("target,fam,head_dim,case,dtype", SHUFFLED)
def test_shuffled_order_changes_nothing(host_build, monkeypatch, target, fam, head_dim, case, dtype):
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    key = (target, fam, head_dim, case, dtype)
    if key not in in_order_results:
        in_order_results[key] = run_case(fam, case, head_dim, dtype)[:2]
    rdnattention.set_host_shuffle(head_dim * 7 + 1)
    try:
        out, lse = run_case(fam, case, head_dim, dtype)[:2]
    finally:
        rdnattention.set_host_shuffle(None)
    ref_out, ref_lse = in_order_results[key]
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
