"""Cache lengths (seqused_k) on the host platform: each batch attends to the first seqused_k[b] keys
of a preallocated cache, queries aligned to the end of those keys, against the float64 oracle."""

import pytest
import torch

from rdnattention import attention_reference, flash_attn, plan_flash_attn, rotary_tables
from rdnattention.errors import InvalidArgumentError

TOL = 2e-3


def _cache(b=3, hq=4, hk=2, sq=5, cache=200, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, sq, d, generator=g).half(), torch.randn(b, hk, cache, d, generator=g).half(),
            torch.randn(b, hk, cache, d, generator=g).half())


def _check(out, lse, ref, ref_lse):
    assert (out.double() - ref).abs().max().item() <= TOL
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() <= TOL


@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"window_size": (40, 0)}, {"window_size": (16, 3)}])
@pytest.mark.parametrize("sq, lengths", [(1, [200, 1, 77]), (5, [200, 37, 0]), (64, [130, 64, 3])])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_the_oracle(host_build, options, sq, lengths, head_dim):
    q, k, v = _cache(sq=sq, d=head_dim)
    seqused = torch.tensor(lengths, dtype=torch.int32)
    out, lse = flash_attn(q, k, v, seqused_k=seqused, return_lse=True, **options)
    ref, ref_lse = attention_reference(q, k, v, seqused_k=seqused, return_lse=True, **options)
    _check(out, lse, ref, ref_lse)


def test_rope_positions_follow_the_used_keys(host_build):
    q, k, v = _cache(sq=3)
    cos, sin = rotary_tables(200, 32)
    seqused = torch.tensor([200, 50, 9], dtype=torch.int32)
    out, lse = flash_attn(q, k, v, is_causal=True, rotary_cos=cos, rotary_sin=sin, seqused_k=seqused, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, is_causal=True, rotary_cos=cos, rotary_sin=sin, seqused_k=seqused,
                                       return_lse=True)
    _check(out, lse, ref, ref_lse)


def test_the_full_length_is_the_same_computation(host_build):
    q, k, v = _cache()
    full = torch.full((3,), 200, dtype=torch.int32)
    assert torch.equal(flash_attn(q, k, v, is_causal=True, seqused_k=full), flash_attn(q, k, v, is_causal=True))


def test_plan_carries_the_lengths(host_build):
    q, k, v = _cache()
    seqused = torch.tensor([10, 20, 30], dtype=torch.int32)
    plan = plan_flash_attn(q, k, v, seqused_k=seqused)
    assert plan.launches[0].args.seqused_k == seqused.data_ptr() and any(t is seqused for t in plan.buffers)
    plan.run()
    assert (plan.outputs[0].double() - attention_reference(q, k, v, seqused_k=seqused)).abs().max() <= TOL


@pytest.mark.parametrize("seqused, message", [
    (torch.tensor([1, 2, 3], dtype=torch.int64), "seqused_k must be int32 [batch] = (3,), got torch.int64 (3,)"),
    (torch.tensor([1, 2], dtype=torch.int32), "seqused_k must be int32 [batch] = (3,), got torch.int32 (2,)"),
    (torch.tensor([1, 201, 3], dtype=torch.int32), "seqused_k values must lie in [0, seq_k = 200], got [1, 201, 3]"),
    (torch.tensor([1, -1, 3], dtype=torch.int32), "seqused_k values must lie in [0, seq_k = 200]"),
    (torch.tensor([1, 0, 2, 0, 3, 0], dtype=torch.int32)[::2], "seqused_k must be contiguous"),
    ([1, 2, 3], "seqused_k must be a torch.Tensor or None, got list"),
])
def test_bad_lengths_are_typed_errors(host_build, seqused, message):
    q, k, v = _cache()
    with pytest.raises(InvalidArgumentError) as err:
        flash_attn(q, k, v, seqused_k=seqused)
    assert message in str(err.value)


def test_opcheck_with_lengths(host_build):
    q, k, v = _cache(sq=8, cache=40)
    seqused = torch.tensor([40, 7, 0], dtype=torch.int32)
    torch.library.opcheck(torch.ops.rdnattention.flash_attn_fwd.default,
                          (q, k, v, None, None, -1, 0, 0.125, False, True, False, seqused),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
