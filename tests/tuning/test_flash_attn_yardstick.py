"""tuning/flash_attn_tests.py (flash-attn's test file run against rdnattention through a flash_attn
shim) on a small synthetic test file written here: each case lands in the bucket it should, the
file's "cuda" is rewritten for the host emulator, the cost bound and --max-cases select cases, and
the shim's helpers (bert_padding, rotary) follow their documented semantics."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from tuning import flash_attn_shim as shim
from tuning import flash_attn_tests as harness

SYNTHETIC = textwrap.dedent('''
    import pytest
    import torch
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.flash_attn_interface import USE_TRITON_ROCM, _get_block_size_n

    is_sm90 = torch.cuda.get_device_capability("cuda") == (9, 0)


    def reference(q, k, v):
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / q.shape[-1] ** 0.5
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float())


    def inputs(requires_grad=False, batch_size=1, seqlen=16, d=64):
        torch.manual_seed(0)
        device = "cuda"
        return [torch.randn(batch_size, seqlen, 2, d, device=device, dtype=torch.float16,
                            requires_grad=requires_grad) for _ in range(3)]


    def test_passes():
        q, k, v = inputs()
        assert q.device.type == "cpu" and is_sm90 and not USE_TRITON_ROCM
        out = flash_attn_func(q, k, v)
        assert (out.float() - reference(q, k, v)).abs().max().item() < 1e-2


    def test_refused():
        q, k, v = inputs()
        flash_attn_func(q, k, v, 0.1)


    def test_gradients():
        q, k, v = inputs(requires_grad=True)
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
        g = torch.randn_like(out)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
        out_ref = reference(q, k, v)
        assert (out.float() - out_ref).abs().max().item() < 1e-2
        dq_ref, dk_ref, dv_ref = torch.autograd.grad(out_ref, (q, k, v), g.float())
        for d, d_ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
            assert (d.float() - d_ref).abs().max().item() < 2e-2


    def test_forward_only():
        q, k, v = inputs(requires_grad=True, d=288)
        out = flash_attn_func(q, k, v)
        g = torch.randn_like(out)
        (dq,) = torch.autograd.grad(out, (q,), g)
        out_ref = reference(q, k, v)
        assert (out.float() - out_ref).abs().max().item() < 1e-2
        (dq_ref,) = torch.autograd.grad(out_ref, (q,), g.float())
        assert (dq.float() - dq_ref).abs().max().item() < 1e-2


    def test_forward_only_tolerance_from_a_gradient():
        q, k, v = inputs(requires_grad=True, d=288)
        out = flash_attn_func(q, k, v)
        (dq,) = torch.autograd.grad(out, (q,), torch.ones_like(out))
        dq_atol = 2 * dq.abs().max().item()
        assert torch.allclose(dq, dq, atol=dq_atol)


    def test_varlen_padded_gradients():
        q, k, v = inputs(requires_grad=True, batch_size=2)
        mask = torch.ones(2, 16, dtype=torch.bool, device="cuda")
        mask[1, 11:] = False
        q_unpad, indices, cu, max_len, _ = unpad_input(q, mask)
        k_unpad, _, _, _, _ = unpad_input(k, mask)
        v_unpad, _, _, _, _ = unpad_input(v, mask)
        out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu, cu, max_len, max_len)
        (dq_unpad,) = torch.autograd.grad(out_unpad, (q_unpad,), torch.ones_like(out_unpad))
        out = pad_input(out_unpad, indices, 2, 16)
        assert (out[0].float() - reference(q[:1], k[:1], v[:1])[0]).abs().max().item() < 1e-2
        dq = pad_input(dq_unpad, indices, 2, 16)
        assert not dq.isnan().any()


    def test_backward_leaf_grad():
        q, k, v = inputs(requires_grad=True, d=288)
        out = flash_attn_func(q, k, v)
        out.backward(torch.ones_like(out))
        assert not q.grad.isnan().any()


    def test_forward_wrong():
        q, k, v = inputs(requires_grad=True)
        out = flash_attn_func(q, k, v)
        (dq,) = torch.autograd.grad(out, (q,), torch.ones_like(out))
        assert (out.float() - 2 * reference(q, k, v)).abs().max().item() < 1e-2
        assert not dq.isnan().any()


    def test_invalid_argument():
        q, k, v = inputs()
        flash_attn_func(q, k, v, window_size="wide")


    def test_skips():
        pytest.skip("not here")


    def test_internals():
        from flash_attn.flash_attn_interface import flash_attn_gpu  # noqa: F401


    @pytest.mark.parametrize("seqlen", [16, 4096])
    def test_cost(seqlen):
        batch_size = 1
        nheads = 2
        q, k, v = inputs(batch_size=batch_size, seqlen=seqlen)
        assert flash_attn_func(q, k, v).shape == q.shape
''')


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("fa") / "test_synthetic_fa.py"
    path.write_text(SYNTHETIC)
    return path


def _buckets(run: harness.Run) -> dict[str, str]:
    return {nodeid.split("::")[-1]: o.bucket for nodeid, o in run.outcomes.items()}


def test_classifies_each_case(synthetic, host_build):
    before = set(sys.modules)
    run = harness.run_tests(synthetic, "cpu", max_cost=2 * 16 * 16 * 64)
    assert _buckets(run) == {
        "test_passes": "passed",
        "test_refused": "refused",
        "test_gradients": "passed",
        "test_forward_only": "forward_only",
        "test_forward_only_tolerance_from_a_gradient": "forward_only",
        "test_varlen_padded_gradients": "passed",
        "test_backward_leaf_grad": "forward_only",
        "test_forward_wrong": "failed",
        "test_invalid_argument": "failed",
        "test_skips": "skipped",
        "test_internals": "not_applicable",
        "test_cost[16]": "passed",
    }
    assert (run.collected, run.over_cost) == (13, 1)
    outcomes = {nodeid.split("::")[-1]: o for nodeid, o in run.outcomes.items()}
    assert "dropout" in outcomes["test_refused"].reason
    assert "InvalidArgumentError" in outcomes["test_invalid_argument"].reason
    assert "line" in outcomes["test_forward_wrong"].reason
    # the refusal of the backward is the reason: no backward kernel for head_dim 288 (nor above) on the host
    assert "no backward kernel" in outcomes["test_forward_only"].reason
    assert outcomes["test_forward_only"].reason.endswith("assertions passed before the first about a gradient: 1")
    assert outcomes["test_backward_leaf_grad"].reason.endswith("(a backward-only test)")
    assert any("cuda" in r for r in run.rewrites)
    assert not any(m == "flash_attn" or m.startswith("flash_attn.") for m in sys.modules)
    assert not any(p.endswith("shim") for p in sys.path)
    assert set(sys.modules) - before <= {m for m in sys.modules if not m.startswith(("flash_attn", "test_"))}
    md = harness.summary(run)
    assert "| failed | 2 |" in md and "test_forward_wrong" in md and "dropout" in md


def test_keyword_and_max_cases(synthetic, host_build):
    run = harness.run_tests(synthetic, "cpu", keyword="cost or skips", max_cost=2 * 16 * 16 * 64, max_cases=2)
    assert _buckets(run) == {"test_cost[16]": "passed", "test_skips": "skipped"}
    assert run.over_cost == 1 and run.not_matching == 10


def test_cpu_source_rewrites():
    text, done = harness.cpu_source('x = torch.cuda.get_device_capability("cuda")\n'
                                    'm = torch.cuda.get_device_properties("cuda").total_memory\n'
                                    "device = 'cuda'\n")
    assert text == 'x = (9, 0)\nm = (1 << 40)\ndevice = "cpu"\n'
    assert len(done) == 3


def test_spread_round_robin():
    class Item:
        def __init__(self, name, i):
            self.originalname, self.i = name, i

    items = [Item("a", i) for i in range(10)] + [Item("b", i) for i in range(2)] + [Item("c", 0)]
    picked = harness.spread(items, 5)
    names = sorted(i.originalname for i in picked)
    assert names == ["a", "a", "b", "b", "c"]
    assert picked == sorted(picked, key=items.index)


def test_unpad_pad_round_trip():
    x = torch.randn(3, 5, 2, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    unpadded, indices, cu, max_len, used = shim.unpad_input(x, mask)
    assert unpadded.shape == (9, 2, 4)
    assert cu.tolist() == [0, 3, 8, 9] and cu.dtype == torch.int32 and max_len == 5 and used.tolist() == [3, 5, 1]
    assert torch.equal(unpadded[3:8], x[1])
    back = shim.pad_input(unpadded, indices, 3, 5)
    assert torch.equal(back, x * mask[..., None, None])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_matches_complex_rotation(interleaved):
    """Channels paired (j, j + rotary_dim/2), or (2j, 2j+1) interleaved, rotated by the angle of
    row position + offset, as a complex multiplication; the channels past rotary_dim kept."""
    torch.manual_seed(0)
    batch, seqlen, heads, head_dim, rotary_dim = 2, 6, 3, 16, 8
    x = torch.randn(batch, seqlen, heads, head_dim)
    angles = torch.rand(20, rotary_dim // 2) * 2 * math.pi
    offsets = torch.tensor([0, 5])
    out = shim.apply_rotary_emb(x, angles.cos(), angles.sin(), interleaved=interleaved, seqlen_offsets=offsets)
    for b in range(batch):
        theta = angles[torch.arange(seqlen) + offsets[b]][:, None, :]
        rot = x[b, ..., :rotary_dim]
        pairs = (torch.complex(rot[..., 0::2], rot[..., 1::2]) if interleaved
                 else torch.complex(rot[..., :rotary_dim // 2], rot[..., rotary_dim // 2:]))
        turned = pairs * torch.polar(torch.ones_like(theta), theta)
        expect = (torch.stack((turned.real, turned.imag), -1).flatten(-2) if interleaved
                  else torch.cat((turned.real, turned.imag), -1))
        assert torch.allclose(out[b, ..., :rotary_dim], expect, atol=1e-6)
        assert torch.equal(out[b, ..., rotary_dim:], x[b, ..., rotary_dim:])
