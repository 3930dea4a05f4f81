"""Every head_dim x every feature on the host platform, against the float64 oracle; then the same
sweep with the emulator's fiber order shuffled at every sync point, which must change nothing."""

import pytest
import torch
from cases import HEAD_DIMS, LSE_TOL, TOL, VARIANTS, make_case

import rdnattention
from rdnattention import attention_reference, flash_attn

# host runs the kernels as the fp16-staging GPU targets build them, host_f32 as sm_90 does.
@pytest.fixture(scope="module", params=["host", "host_f32"])
def host_target(request, host_build, monkeypatch_module):
    monkeypatch_module.setenv("RDNATTENTION_HOST_TARGET", request.param)
    return request.param


@pytest.fixture(scope="module")
def in_order_results(host_target):
    return {}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_matches_oracle(in_order_results, head_dim, variant):
    q, k, v, options = make_case(variant, head_dim)
    out, lse = flash_attn(q, k, v, return_lse=True, **options)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL, f"max abs error {err:.2e}"
    lse_err = (lse.double() - ref_lse).abs().max().item()
    assert lse_err <= LSE_TOL, f"lse error {lse_err:.2e}"
    in_order_results[(head_dim, variant)] = (out, lse)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_shuffled_order_changes_nothing(in_order_results, head_dim, variant):
    if (head_dim, variant) not in in_order_results:
        pytest.skip("the in-order run of this case did not pass")
    q, k, v, options = make_case(variant, head_dim)
    rdnattention.set_host_shuffle(head_dim * 7 + 1)
    try:
        out, lse = flash_attn(q, k, v, return_lse=True, **options)
    finally:
        rdnattention.set_host_shuffle(None)
    ref_out, ref_lse = in_order_results[(head_dim, variant)]
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
