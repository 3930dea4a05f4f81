"""Every head_dim x every feature on the host platform, against the float64 oracle; then the same
sweep with the emulator's fiber order shuffled at every sync point, which must change nothing."""

import pytest
import torch

import rdnattention
from rdnattention import attention_reference, flash_attn, rotary_tables

HEAD_DIMS = list(range(32, 513, 32))
TOL = 2e-3      # output: fp16 rounding of the result, of the probabilities and (RoPE) of rotated Q/K
LSE_TOL = 2e-3  # log-sum-exp, fp32

# name: (batch, heads_q, heads_kv, seq_q, seq_k, options)
VARIANTS = {
    "plain": (2, 2, 2, 100, 100, {}),
    "causal": (1, 2, 2, 150, 150, {"is_causal": True}),
    "window_left": (1, 2, 2, 150, 150, {"is_causal": True, "window_size": (37, -1)}),
    "window_two_sided": (1, 2, 2, 140, 140, {"window_size": (21, 9)}),
    "gqa": (1, 4, 2, 97, 97, {"is_causal": True}),
    "mqa": (1, 3, 1, 80, 80, {}),
    "cross": (1, 2, 2, 45, 170, {"is_causal": True}),
    "decode": (2, 4, 2, 1, 203, {}),
    "rope": (1, 4, 2, 90, 90, {"is_causal": True, "rope": True}),
}


def _case(name, head_dim):
    b, hq, hk, sq, sk, options = VARIANTS[name]
    g = torch.Generator().manual_seed(head_dim * 100 + list(VARIANTS).index(name))
    q = torch.randn(b, hq, sq, head_dim, generator=g).half()
    k = torch.randn(b, hk, sk, head_dim, generator=g).half()
    v = torch.randn(b, hk, sk, head_dim, generator=g).half()
    options = dict(options)
    if options.pop("rope", False):
        # Partial rotation where head_dim allows it, rotate-half and interleaved alternating.
        rotary_dim = head_dim if head_dim <= 64 else head_dim // 2
        options["rotary_cos"], options["rotary_sin"] = rotary_tables(sk + 3, rotary_dim)
        options["rotary_interleaved"] = head_dim % 64 == 0
    return q, k, v, options


@pytest.fixture(scope="module")
def in_order_results(host_build):
    return {}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_matches_oracle(in_order_results, head_dim, variant):
    q, k, v, options = _case(variant, head_dim)
    out, lse = flash_attn(q, k, v, return_lse=True, **options)
    ref, ref_lse = attention_reference(q, k, v, return_lse=True, **options)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL, f"max abs error {err:.2e}"
    lse_err = (lse.double() - ref_lse).abs().max().item()
    assert lse_err <= LSE_TOL, f"lse error {lse_err:.2e}"
    in_order_results[(head_dim, variant)] = (out, lse)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_shuffled_order_changes_nothing(in_order_results, head_dim, variant):
    if (head_dim, variant) not in in_order_results:
        pytest.skip("the in-order run of this case did not pass")
    q, k, v, options = _case(variant, head_dim)
    rdnattention.set_host_shuffle(head_dim * 7 + 1)
    try:
        out, lse = flash_attn(q, k, v, return_lse=True, **options)
    finally:
        rdnattention.set_host_shuffle(None)
    ref_out, ref_lse = in_order_results[(head_dim, variant)]
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
