"""The generic oracle sweep on the host platform: every family of the matrix x every head_dim the
host targets build for it x every case the family declares (tests/cases.py), through the entry
point that serves the family, against the float64 oracle, checking that the family did run; then
the fp16 family's cases again with the emulator's fiber order shuffled at every sync point, which
must change nothing."""

import pytest
import torch
from cases import INT8_LSE_TOL, INT8_REL_RMS, LSE_TOL, TOL, run_case, sweep

import rdnattention
from rdnattention import replay, route
from rdnattention_gen.families import family
from rdnattention_gen.matrix import load_matrix

SWEEP = sweep()
IDS = ["-".join(map(str, p)) for p in SWEEP]
# The in-order results of the sweep, for the shuffled run.
in_order_results = {}


def test_every_family_declares_cases_and_is_swept():
    for name in load_matrix().kernels:
        assert family(name).oracle_cases, f"family {name} declares no oracle_cases"
        assert any(p[1] == name for p in SWEEP), f"the host targets build no {name} kernel to sweep"


@pytest.fixture
def families_run(monkeypatch):
    """The families of the kernels each call planned (route.plan), with the fp16 replay cache empty
    so that every call is planned."""
    ran = []
    plan = route.plan

    def recording(table, call):
        p = plan(table, call)
        ran.append({launch.kernel.family for launch in p.launches})
        return p

    monkeypatch.setattr(route, "plan", recording)
    monkeypatch.setattr(replay, "cache", {})
    return ran


@pytest.mark.parametrize("target,fam,head_dim,case", SWEEP, ids=IDS)
def test_matches_oracle(host_build, monkeypatch, families_run, target, fam, head_dim, case):
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    out, lse, ref, ref_lse, int8 = run_case(fam, case, head_dim)
    assert families_run and all(fam in ran for ran in families_run), \
        f"the call ran the families {families_run}, not {fam}"
    assert torch.isfinite(out).all()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    if int8:
        rel_rms = ((out.double() - ref).norm() / ref.norm()).item()
        assert rel_rms <= INT8_REL_RMS, f"relative RMS error {rel_rms:.2e}"
        assert lse_err <= INT8_LSE_TOL, f"lse error {lse_err:.2e}"
    else:
        err = (out.double() - ref).abs().max().item()
        assert err <= TOL, f"max abs error {err:.2e}"
        assert lse_err <= LSE_TOL, f"lse error {lse_err:.2e}"
    in_order_results[(target, fam, head_dim, case)] = (out, lse)


FP16 = [p for p in SWEEP if p[1] == "f16"]


@pytest.mark.parametrize("target,fam,head_dim,case", FP16, ids=["-".join(map(str, p)) for p in FP16])
def test_shuffled_order_changes_nothing(host_build, monkeypatch, target, fam, head_dim, case):
    if (target, fam, head_dim, case) not in in_order_results:
        pytest.skip("the in-order run of this case did not pass")
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    rdnattention.set_host_shuffle(head_dim * 7 + 1)
    try:
        out, lse = run_case(fam, case, head_dim)[:2]
    finally:
        rdnattention.set_host_shuffle(None)
    ref_out, ref_lse = in_order_results[(target, fam, head_dim, case)]
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
