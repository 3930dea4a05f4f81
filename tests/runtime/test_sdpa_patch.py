"""rdnattention.patch_sdpa on the host emulator: torch's SDPA replaced and put back (the same object),
the calls the kernels serve (masks read as bands and key lengths, is_causal, GQA, 3-D inputs,
autocast) equal to torch's in float32 within fp16 rounding, and every other call run by torch's
own function with its arguments unchanged, counted by reason in stats() and logged once."""

import contextlib
import logging
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import rdnattention
from conftest import REPO_ROOT
from rdnattention import ops
from rdnattention.errors import InvalidArgumentError, LaunchError
from rdnattention.integrations import sdpa as patch

ORIGINAL = F.scaled_dot_product_attention
TOL = dict(atol=3e-3, rtol=3e-3)


@pytest.fixture(autouse=True)
def _never_left_patched(sdpa_restored):  # conftest: unpatched after every test
    yield


@pytest.fixture
def patched(host_build):
    """Patched for CPU tensors (the host emulator), strict: an error after a call was found
    servable would propagate instead of falling back."""
    rdnattention.patch_sdpa(devices="cpu", strict=True)
    rdnattention.stats(reset=True)
    yield
    rdnattention.unpatch_sdpa()
    assert F.scaled_dot_product_attention is ORIGINAL


def _qkv(b=2, hq=2, hk=2, sq=24, sk=40, d=32, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g).to(dtype) for h, s in ((hq, sq), (hk, sk), (hk, sk)))


def _reference(q, k, v, **kw):
    """torch's SDPA in float32 on the same inputs (masks kept: bool stays bool)."""
    mask = kw.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kw["attn_mask"] = mask.float()
    return ORIGINAL(q.float(), k.float(), v.float(), **kw)


def _served(n=1):
    s = rdnattention.stats()
    assert (s["served"], s["fallbacks"]) == (n, {}), s


I = torch.arange(24)[:, None]  # query rows (seq_q 24)
J = torch.arange(40)  # keys (seq_k 40)
LENGTHS = torch.tensor([30, 12])[:, None, None, None]  # per-sequence key lengths of a batch of 2
FIRST = torch.tensor([0, 10])[:, None, None, None]  # left padding: the first real key of each sequence


def _additive(visible, hidden=float("-inf"), dtype=torch.float16):
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, hidden)


MASKS = {
    "all visible": torch.ones(24, 40, dtype=torch.bool),
    "causal top-left": J <= I,
    "causal bottom-right": J <= I + 16,
    "sliding window": (J <= I + 16) & (J >= I + 16 - 5),
    "window both sides": (J <= I + 3) & (J >= I - 2),
    "key lengths": (J < LENGTHS).expand(2, 1, 1, 40),
    "key lengths, additive -inf": _additive((J < LENGTHS).expand(2, 1, 1, 40)),
    "key lengths, additive -10000": _additive((J < LENGTHS).expand(2, 1, 1, 40), -10000.0),
    "key lengths, float32 mask": _additive((J < LENGTHS).expand(2, 1, 1, 40), dtype=torch.float32),
    "key lengths and causal": (J < LENGTHS) & (J <= I),
    "left padding and causal": (J >= FIRST) & (J <= I + 16),
    "every head the same": ((J <= I + 16) & (J < LENGTHS)).expand(2, 2, 24, 40).clone(),
    "query rows that see no key": J <= I - 20,  # rows 0..19: zeros, as torch gives from 2.5 on
    "no key at all": torch.zeros(24, 40, dtype=torch.bool),
    "keys after the query only": J > I + 16,  # rows 23 on see none
    "keys far after the query": (J >= I + 30) & (J < 38),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_masks_that_are_bands_of_keys_are_served(patched, name):
    q, k, v = _qkv()
    mask = MASKS[name]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == torch.float16 and out.shape == q.shape
    torch.testing.assert_close(out.float(), _reference(q, k, v, attn_mask=mask), **TOL)
    _served()


@pytest.mark.parametrize("sq, sk", [(24, 40), (40, 24), (24, 24), (1, 40)])
def test_is_causal_is_top_left_as_torch_defines_it(patched, sq, sk):
    q, k, v = _qkv(sq=sq, sk=sk)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.float(), _reference(q, k, v, is_causal=True), **TOL)
    _served()


@pytest.mark.parametrize("causal", [False, True])
def test_a_served_output_is_token_major_as_torchs_flash_attention_returns_it(patched, monkeypatch, causal):
    """The output of a call the kernels serve whole, planned, replayed or through the replay's
    express function alike, is a [batch, heads, seq_q, head_dim] view of a token-major buffer, as
    torch's own SDPA returns it here (its flash attention on the CPU): what transformers' sdpa
    attention does after the call, transpose(1, 2).contiguous(), copies nothing."""
    from rdnattention import replay
    monkeypatch.setattr(patch, "_express", replay.LastExpress())
    served = []
    make = replay.express
    monkeypatch.setattr(replay, "express", lambda *a: (lambda run: run and (
        lambda *t: served.append(run(*t)) or served[-1]))(make(*a)))
    q, k, v = _qkv(hq=4, hk=2, sq=24, sk=24)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # as transformers gives it: a token-major buffer's view
    mine = ORIGINAL(q.float(), k.float(), v.float(), is_causal=causal, enable_gqa=True)
    assert mine.transpose(1, 2).is_contiguous()  # torch's own layout, which the patch matches
    for _ in range(6):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
        assert out.transpose(1, 2).contiguous().data_ptr() == out.data_ptr()
        torch.testing.assert_close(out.float(), _reference(q, k, v, is_causal=causal, enable_gqa=True), **TOL)
    assert served and all(x is not None for x in served)  # the last calls went through the express
    _served(6)


def test_the_express_serves_only_the_options_it_was_made_under(patched):
    """The express function made for a geometry is tried first, before the checks its guard stands
    for, but only for a call with the options it was made under (is_causal, scale, enable_gqa and
    the patch's settings): the same tensors with other options get their own outputs, and a GQA
    call without enable_gqa still gets torch's error."""
    q, k, v = _qkv(hq=4, hk=2, sq=24, sk=24)
    base = dict(is_causal=True, enable_gqa=True)
    for kw in [dict(is_causal=False, enable_gqa=True), dict(base, scale=0.3), base]:
        for one in (base,) * 4 + (kw,):  # the express made for base's options, then a call of kw's
            assert patch._express.made or one is base  # made by the fourth call of base's
            out = F.scaled_dot_product_attention(q, k, v, **one)
            torch.testing.assert_close(out.float(), _reference(q, k, v, **one), **TOL)
    with pytest.raises(RuntimeError):  # torch's own error for heads that differ without enable_gqa
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rdnattention.patch_sdpa(devices="cuda", strict=True)  # CPU tensors no longer served: torch runs them
    before = rdnattention.stats()["served"]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out.float(), _reference(q, k, v, is_causal=True, enable_gqa=True), **TOL)
    assert rdnattention.stats()["served"] == before


def test_gqa_scale_and_positional_arguments(patched):
    q, k, v = _qkv(hq=4, hk=2)
    mask = J <= I + 16
    out = F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out.float(), _reference(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True), **TOL)
    _served()


@pytest.mark.parametrize("gqa", [False, True])
def test_three_dimensional_inputs(patched, gqa):
    q, k, v = (t[0] for t in _qkv(hq=4, hk=2 if gqa else 4))  # [heads or batch, seq, head_dim]
    mask = (J < torch.tensor([30, 12, 40, 7])[:, None, None]) if not gqa else J <= I
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    assert out.shape == q.shape
    torch.testing.assert_close(out.float(), _reference(q, k, v, attn_mask=mask, enable_gqa=gqa), **TOL)
    _served()


@pytest.mark.parametrize("d, seqused", [(64, True), (32, False)])
def test_key_lengths_run_one_call_where_the_len_kernels_are_built(patched, d, seqused):
    # The host has kernels of layout len (per-sequence key counts) for head_dim 64, not 32: there,
    # one call per sequence on the plain kernels.
    q, k, v = _qkv(d=d)
    mask = J < LENGTHS
    run = patch._decide(patch._config, q, k, v, mask, 0.0, False, None, False)
    assert (run.seqused, len(run.slices)) == (seqused, 2)
    torch.testing.assert_close(run.run().float(), _reference(q, k, v, attn_mask=mask), **TOL)


def test_autocast_to_float16_is_served_as_torch_would_cast(patched):
    q, k, v = _qkv(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.float16):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), _reference(q, k, v, is_causal=True), **TOL)
    _served()


# bf16: the same comparison with bf16's unit roundoff, 8x fp16's (2^-8 vs 2^-11; tests/cases.py).
BF16_TOL = dict(atol=8 * TOL["atol"], rtol=8 * TOL["rtol"])


def test_bfloat16_is_served(patched):
    q, k, v = _qkv(d=64, dtype=torch.bfloat16)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, k, v, is_causal=True), **BF16_TOL)
    _served()


def test_autocast_to_bfloat16_is_served_as_torch_would_cast(patched):
    q, k, v = _qkv(d=64, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    cast = (t.bfloat16() for t in (q, k, v))  # what autocast hands the operator
    torch.testing.assert_close(out.float(), _reference(*cast, is_causal=True), **BF16_TOL)
    _served()


def _nested():
    q = torch.nested.nested_tensor([torch.randn(2, 5, 32), torch.randn(2, 7, 32)], dtype=torch.float16)
    return q, q, q


class _Sub(torch.Tensor):
    pass


FALLBACKS = {
    # name: (make inputs, keyword arguments, reason)
    "float32": (lambda: _qkv(dtype=torch.float32), {}, "dtype torch.float32"),
    # bf16 kernels are built at the bf16 checkpoints' head_dims (64, 80, 96, 128, 256), not at 32
    "bfloat16 at head_dim 32": (lambda: _qkv(dtype=torch.bfloat16), {}, "head_dim 32"),
    "head_dim 12": (lambda: _qkv(d=12), {}, "head_dim 12"),
    "dropout": (_qkv, {"dropout_p": 0.5}, "dropout"),
    "a bias": (_qkv, {"attn_mask": torch.randn(24, 40).half()}, "attn_mask values"),
    "heads differ": (_qkv, {"attn_mask": torch.stack([J <= I, J <= I + 16])[None]}, "attn_mask pattern"),
    "not a band": (_qkv, {"attn_mask": (I + J) % 3 == 0}, "attn_mask pattern"),
    "a row without keys, -10000": (_qkv, {"attn_mask": _additive(J <= I - 20, -10000.0)},
                                   "attn_mask rows without keys"),
    "a row without keys amid others": (_qkv, {"attn_mask": (J <= I + 16) & (I != 5)}, "attn_mask pattern"),
    "five dimensions": (lambda: tuple(t[None] for t in _qkv()), {}, "rank"),
    "value head_dim": (lambda: (*_qkv()[:2], _qkv(d=64)[2]), {}, "value head_dim"),
    "meta tensors": (lambda: tuple(t.to("meta") for t in _qkv()), {}, "device meta"),
    "tensor subclass": (lambda: tuple(t.as_subclass(_Sub) for t in _qkv()), {}, "tensor subclass"),
    "empty": (lambda: _qkv(sq=0), {}, "empty"),
    "nested": (_nested, {}, "nested tensors"),
}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")

@pytest.mark.parametrize("name", list(FALLBACKS))
def test_what_the_kernels_do_not_serve_runs_torchs_function_counted_and_logged_once(patched, name, caplog):
    make, kw, reason = FALLBACKS[name]
    q, k, v = make()
    with caplog.at_level(logging.WARNING, logger=patch.__name__):
        torch.manual_seed(1)
        outs = [F.scaled_dot_product_attention(q, k, v, **kw) for _ in range(2)]
    torch.manual_seed(1)
    ref = ORIGINAL(q, k, v, **kw)
    if q.device.type != "meta" and not q.is_nested:
        assert torch.equal(outs[0], ref)
    s = rdnattention.stats()
    assert (s["served"], s["fallback"], s["fallbacks"]) == (0, 2, {reason: 2}), s
    assert len(caplog.records) == 1 and reason in caplog.records[0].getMessage()


def _grads(fn, q, k, v, g, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kw)
    out.backward(g)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("mask", [None, "causal", "key lengths"])
def test_gradients_run_rdnattentions_backward_where_it_has_one(patched, mask):
    """Inputs that require grad run the kernels, forward and backward, where the target has backward
    kernels for the head_dim (64 on the host): gradients equal torch's float32 ones within fp16
    rounding, and a mask that is a band (here key padding: one call per sequence) serves too."""
    q, k, v = _qkv(sq=24, sk=24, d=64)
    kw = {"is_causal": True} if mask == "causal" else {}
    if mask == "key lengths":
        lengths = torch.tensor([24, 17])
        kw = {"attn_mask": (torch.arange(24)[None, :] < lengths[:, None])[:, None, None, :]}
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).half()
    ours = _grads(F.scaled_dot_product_attention, q, k, v, g, **kw)
    ref = _grads(_reference, q, k, v, g.float(), **kw)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
    _served(1)


@pytest.mark.parametrize("lengths,seq_q,causal", [((24, 17, 0, 9), 24, False), ((24, 17, 5, 9), 4, True)])
def test_gradients_of_a_key_padding_mask_run_one_call_with_key_counts(patched, monkeypatch, lengths, seq_q, causal):
    """Key padding with gradients (each sequence's first keys, one window: none, or causal with the
    queries at the end of the keys; a sequence may have no key): one forward and one backward, each
    given the sequences' key counts (seqused_k), no call per sequence; the output and the gradients
    are torch's float32 ones within fp16 rounding (its rows that see no key: zero), and the keys
    past each sequence's length get none."""
    batch, seq_k = len(lengths), 24
    q, k, v = _qkv(b=batch, hq=4, hk=2, sq=seq_q, sk=seq_k, d=64)
    n = torch.tensor(lengths)[:, None, None, None]
    j, i = torch.arange(seq_k), torch.arange(seq_q)[:, None]
    mask = (j < n) & ((j <= i + n - seq_q) if causal else True)  # [batch, 1, seq_q, seq_k]
    monkeypatch.setattr(patch._Run, "_one", lambda *a: pytest.fail("a call per sequence"))
    backwards = []
    real_backward = ops.backward

    def backward(*args, **kwargs):
        backwards.append(kwargs.get("seqused_k"))
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(ops, "backward", backward)
    kw = {"attn_mask": mask, "enable_gqa": True}
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).half()
    ours = _grads(F.scaled_dot_product_attention, q, k, v, g, **kw)
    ref = _grads(_reference, q, k, v, g.float(), **kw)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a.float(), b.float().nan_to_num(0.0), atol=1e-2, rtol=1e-2)
    for b, length in enumerate(lengths):
        assert not ours[2][b, :, length:].any() and not ours[3][b, :, length:].any()
    (counts,) = backwards
    assert counts.tolist() == list(lengths)
    _served(1)


def test_gradients_of_a_call_where_no_query_sees_a_key(patched):
    """A mask that hides every key: the output is zero, as torch's, and a loss of it alone
    backpropagates to zero gradients, as torch's does (the output is recorded by autograd)."""
    q, k, v = _qkv(d=64)
    mask = torch.zeros(24, 40, dtype=torch.bool)
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).half()
    ours = _grads(F.scaled_dot_product_attention, q, k, v, g, attn_mask=mask)
    ref = _grads(_reference, q, k, v, g.float(), attn_mask=mask)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.float16 and not a.any()
        assert torch.equal(a.float(), b.nan_to_num(0.0))
    _served(1)


def test_gradients_without_a_backward_kernel_run_torchs_function(patched):
    q, k, v = (t.requires_grad_() for t in _qkv(d=288))  # no backward kernel at 288 nor above on the host
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.float().sum().backward()
    assert q.grad is not None
    assert rdnattention.stats()["fallbacks"] == {"requires grad": 1}
    with torch.no_grad():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rdnattention.stats()["served"] == 1


def test_gradients_of_a_head_dim_without_its_own_backward_kernels_run_the_next_ones(patched):
    """head_dim 32 has no backward kernels on the host: its gradients run head_dim 40's on padded
    copies, served and counted, as torch's float32 gradients to fp16 rounding."""
    q, k, v = (t.requires_grad_() for t in _qkv())  # head_dim 32
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).half()
    ours = _grads(F.scaled_dot_product_attention, q, k, v, g, is_causal=True)
    ref = _grads(_reference, q, k, v, g.float(), is_causal=True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
    s = rdnattention.stats()
    assert (s["served"], s["fallbacks"]) == (1, {})
    assert s["backward"] == {"padded": 1, "head_dims": {"host fp16 head_dim 32 -> 40": 1}, "rotary": 0}


def test_calls_torch_may_refuse_get_torchs_answer(patched):
    q, k, v = _qkv()
    both = {"attn_mask": J <= I, "is_causal": True}  # torch's backends differ on this: its answer, whatever it is
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, **both), ORIGINAL(q, k, v, **both))
    for kw in ({"attn_mask": torch.zeros(24, 40, dtype=torch.int32)}, {"bogus": 1}):
        with pytest.raises((RuntimeError, TypeError)) as ours:
            F.scaled_dot_product_attention(q, k, v, **kw)
        with pytest.raises(type(ours.value)):
            ORIGINAL(q, k, v, **kw)
    assert rdnattention.stats()["fallbacks"] == {"arguments": 3}


def test_devices_not_asked_for_run_torchs_function(host_build):
    q, k, v = _qkv()
    with rdnattention.sdpa_patched():  # GPUs only, the default
        stats = rdnattention.stats(reset=True)
        assert torch.equal(F.scaled_dot_product_attention(q, k, v), ORIGINAL(q, k, v))
        assert rdnattention.stats()["fallbacks"] == {"device cpu": 1}
    assert stats["patched"] and not rdnattention.stats()["patched"]


def test_a_device_without_kernels_runs_torchs_function(host_build, monkeypatch):
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", "no_such_target")
    q, k, v = _qkv()
    with rdnattention.sdpa_patched(devices="cpu"):
        rdnattention.stats(reset=True)
        for _ in range(2):
            assert torch.equal(F.scaled_dot_product_attention(q, k, v), ORIGINAL(q, k, v))
        assert rdnattention.stats()["fallbacks"] == {"no kernels for cpu": 2}


def test_patching_is_idempotent_and_restores_the_original_object(host_build):
    assert F.scaled_dot_product_attention is ORIGINAL and not patch.is_patched()
    rdnattention.unpatch_sdpa()  # not patched: nothing to do
    rdnattention.patch_sdpa(devices="cpu")
    rdnattention.patch_sdpa(devices=["cpu", "cuda"], device_masks=False)  # settings updated, one layer
    assert F.scaled_dot_product_attention is patch.sdpa and patch._original is ORIGINAL
    assert patch._config.devices == {"cpu", "cuda"} and not patch._config.device_masks
    with rdnattention.sdpa_patched(devices="cuda"):
        assert patch._config.devices == {"cuda"}
    assert patch._config.devices == {"cpu", "cuda"}  # the settings before the block are back
    rdnattention.unpatch_sdpa()
    rdnattention.unpatch_sdpa()
    assert F.scaled_dot_product_attention is ORIGINAL and torch._C._nn.scaled_dot_product_attention is ORIGINAL
    with rdnattention.sdpa_patched(devices="cpu"):
        assert F.scaled_dot_product_attention is patch.sdpa
    assert F.scaled_dot_product_attention is ORIGINAL


def test_a_later_patch_on_top_is_left_in_place(host_build):
    rdnattention.patch_sdpa(devices="cpu")
    def theirs(*args, **kwargs):
        return patch.sdpa(*args, **kwargs)
    F.scaled_dot_product_attention = theirs
    try:
        rdnattention.unpatch_sdpa()
        assert F.scaled_dot_product_attention is theirs
        rdnattention.stats(reset=True)
        q, k, v = _qkv()
        assert torch.equal(theirs(q, k, v), ORIGINAL(q, k, v))  # passed on, uncounted
        assert rdnattention.stats()["served"] == rdnattention.stats()["fallback"] == 0
    finally:
        F.scaled_dot_product_attention = ORIGINAL


@pytest.mark.parametrize("kw, message", [
    ({"devices": "gpu"}, "devices must be"), ({"devices": []}, "devices must be"), ({"devices": 3}, "devices must be"),
    ({"device_masks": 1}, "device_masks must be a bool"), ({"strict": None}, "strict must be a bool"),
])
def test_bad_settings_are_refused(kw, message):
    with pytest.raises(InvalidArgumentError, match=message):
        rdnattention.patch_sdpa(**kw)
    assert F.scaled_dot_product_attention is ORIGINAL


@pytest.mark.parametrize("value, devices", [("", None), ("0", None), ("off", None), ("1", {"cuda"}),
                                            ("cuda,cpu", {"cuda", "cpu"}), (" CPU ", {"cpu"})])
def test_the_environment_variable(value, devices):
    try:
        assert patch.patch_from_env(value) == (devices is not None)
        assert (patch._config.devices if patch.is_patched() else None) == devices
    finally:
        rdnattention.unpatch_sdpa()
    with pytest.raises(InvalidArgumentError, match="RDNATTENTION_PATCH_SDPA='gpu'"):
        patch.patch_from_env("gpu")


def test_the_environment_variable_patches_on_import(host_build):
    code = ("import rdnattention, torch, torch.nn.functional as F; q = torch.randn(1, 2, 8, 32).half(); "
            "F.scaled_dot_product_attention(q, q, q); print(F.scaled_dot_product_attention.__module__, "
            "rdnattention.stats()['served'])")
    env = {**__import__("os").environ, "RDNATTENTION_PATCH_SDPA": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["rdnattention.integrations.sdpa", "1"]


def test_the_runner_patches_a_program_that_never_imports_rdnattention(host_build, tmp_path):
    script = tmp_path / "program.py"
    script.write_text("import sys, torch, torch.nn.functional as F\n"
                      "q = torch.randn(1, 2, 8, 32).half()\n"
                      "F.scaled_dot_product_attention(q, q, q, is_causal=True)\n"
                      "import rdnattention\n"
                      "print(sys.argv[1:], rdnattention.stats()['served'])\n")
    env = {**__import__("os").environ, "RDNATTENTION_PATCH_SDPA": "cpu", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-m", "rdnattention.patched", str(script), "a", "--b"], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['a', '--b'] 1"
    usage = subprocess.run([sys.executable, "-m", "rdnattention.patched"], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "usage: python -m rdnattention.patched" in usage.stderr


def test_a_kernel_error_falls_back_unless_strict(patched, monkeypatch, caplog):
    def fail(*args, **kwargs):
        raise LaunchError("the device refused the launch")
    monkeypatch.setattr(ops, "forward", fail)
    q, k, v = _qkv(sq=3)  # a geometry not replayed from an earlier test
    with pytest.raises(LaunchError):
        F.scaled_dot_product_attention(q, k, v)
    rdnattention.patch_sdpa(devices="cpu")
    with caplog.at_level(logging.WARNING, logger=patch.__name__):
        assert torch.equal(F.scaled_dot_product_attention(q, k, v), ORIGINAL(q, k, v))
    assert rdnattention.stats()["fallbacks"] == {"error: LaunchError": 1}
    assert "the device refused the launch" in caplog.text


def test_an_error_while_reading_a_mask_falls_back_unless_strict(patched, monkeypatch):
    def fail(*args):
        raise RuntimeError("out of memory reading the mask")
    monkeypatch.setattr(patch, "_read", fail)
    q, k, v = _qkv()
    mask = J <= I + 16
    with pytest.raises(RuntimeError, match="out of memory"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    rdnattention.patch_sdpa(devices="cpu")
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), ORIGINAL(q, k, v, attn_mask=mask))
    assert rdnattention.stats()["fallbacks"] == {"error: RuntimeError": 1}


def test_a_function_mode_sees_the_patched_function_which_then_serves(patched):
    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv()
    with Record():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert F.scaled_dot_product_attention in seen
    with torch.device("cpu"):  # a default-device mode
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.float(), _reference(q, k, v, is_causal=True), **TOL)
    _served(2)


def test_a_dispatch_mode_runs_torchs_function(patched):
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv()
    with Record():
        out = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, ORIGINAL(q, k, v)) and seen  # torch's operators ran, seen by the mode
    assert rdnattention.stats()["fallbacks"] == {"dispatch mode": 1}


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
def test_traced_calls_put_torchs_operator_into_the_graph(patched):
    q, k, v = _qkv()

    def layer(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), ORIGINAL(q, k, v, is_causal=True) * 2)
    traced = torch.jit.trace(layer, (q, k, v), check_trace=False)
    assert "scaled_dot_product_attention" in str(traced.graph)
    assert rdnattention.stats()["served"] == 0


def test_a_mask_is_read_once_while_unmodified(patched, monkeypatch):
    reads = []
    read = patch._read
    monkeypatch.setattr(patch, "_read", lambda *a: reads.append(1) or read(*a))
    q, k, v = _qkv()
    mask = J <= I + 16
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(reads) == 1
    mask[5, 30] = True  # no longer a band
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(reads) == 2
    assert rdnattention.stats()["fallbacks"] == {"attn_mask pattern": 1}


def test_counts_are_exact_across_threads(patched):
    q, k, v = _qkv(sq=1, d=64)
    qf = q.float()

    def work():
        for _ in range(5):
            F.scaled_dot_product_attention(q, k, v)
            F.scaled_dot_product_attention(qf, qf, qf)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = rdnattention.stats()
    assert (s["served"], s["fallbacks"]) == (20, {"dtype torch.float32": 20})


@pytest.mark.parametrize("seed", range(12))
def test_random_bands_per_sequence(patched, seed):
    # Per sequence: keys [k0, n) and a band lo..hi around each query (either side possibly
    # unbounded), as a boolean or an additive mask; rows that see no key are zeros in both.
    g = torch.Generator().manual_seed(seed)
    sq, sk = [(24, 40), (40, 24), (33, 33), (1, 40)][seed % 4]
    q, k, v = _qkv(b=3, sq=sq, sk=sk, seed=seed)
    i, j = torch.arange(sq)[:, None], torch.arange(sk)

    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=g))

    masks = []
    for _ in range(3):
        k0 = rand(0, sk // 3)
        n = rand(k0 + 1, sk)
        band = ((j >= k0) & (j < n)).expand(sq, sk)
        if rand(0, 1):
            band = band & (j >= i + rand(-sq, sk // 2))
        if rand(0, 1):
            band = band & (j <= i + rand(-sq // 2, sk))
        masks.append(band)
    mask = torch.stack(masks)[:, None]
    if seed % 3 == 2:
        mask = _additive(mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = _reference(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.float(), ref, **TOL)
    _served()


@pytest.mark.gpu
def test_gpu_masks_are_read_on_the_device_once_and_capture_falls_back():
    if not torch.cuda.is_available() or torch.version.hip is not None:
        pytest.skip("needs an NVIDIA GPU")
    dev = torch.device("cuda")
    q, k, v = (t.to(dev) for t in _qkv(d=64))
    with rdnattention.sdpa_patched(strict=True):
        for name in ("causal bottom-right", "sliding window", "key lengths", "key lengths, additive -inf",
                     "left padding and causal", "keys far after the query"):
            rdnattention.stats(reset=True)
            mask = MASKS[name].to(dev)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            torch.testing.assert_close(out.float(), _reference(q, k, v, attn_mask=mask), **TOL)
            _served()
        mask = MASKS["key lengths"].to(dev)
        rdnattention.patch_sdpa(device_masks=False)
        rdnattention.stats(reset=True)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert rdnattention.stats()["fallbacks"] == {"attn_mask on the device": 1}
        rdnattention.patch_sdpa()
        F.scaled_dot_product_attention(q, k, v, is_causal=True)  # loads the code object before capture
        graph = torch.cuda.CUDAGraph()
        rdnattention.stats(reset=True)
        with torch.cuda.graph(graph):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert rdnattention.stats()["fallbacks"] == {"CUDA graph capture": 1}


def test_a_served_call_without_a_mask_replays_before_the_checks(patched, monkeypatch):
    """A second call of a geometry served before (no mask, positional q, k, v) runs its kept launch
    without _decide, and gives the first call's result; a call whose keys are cut by torch's
    top-left causal mask (seq_k > seq_q) replays on the same keys the first call used."""
    decided = []
    decide = patch._decide
    monkeypatch.setattr(patch, "_decide", lambda *a, **kw: decided.append(1) or decide(*a, **kw))
    for kw in ({}, {"is_causal": True}, {"is_causal": True, "scale": 0.3, "dropout_p": 0.0}):
        q, k, v = _qkv(hq=4, hk=2, sq=8, sk=40)
        decided.clear()
        first = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        again = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        assert len(decided) == 1, kw
        assert torch.equal(first, again)
        torch.testing.assert_close(again.float(), _reference(q, k, v, enable_gqa=True, **kw), **TOL)
    _served(6)


def _dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    return Record()


def _function_mode():
    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    return Record()


@pytest.mark.parametrize("state, fallbacks", [
    ("dispatch mode", {"dispatch mode": 1}),
    ("function mode", {}),  # the mode sees the function, which then serves (as without a replay)
    ("autocast to bfloat16", {}),  # served in bfloat16, as torch would cast
    ("dropout", {"dropout": 1}),
    ("enable_gqa False", {"shapes": 1}),
    ("other devices patched", {"device cpu": 1}),
])
def test_what_the_replay_key_does_not_hold_is_checked_as_without_it(patched, state, fallbacks):
    """After a served call, the same geometry under a state the replay key does not hold takes the
    path a first call would: the checks _decide makes, the same fallback and result."""
    q, k, v = _qkv(hq=4, hk=2, sq=1, sk=40, d=64)  # (bf16 kernels are built at 64 on the host)
    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # kept
    rdnattention.stats(reset=True)
    want = _reference(q, k, v, enable_gqa=True)
    kw = {"enable_gqa": True}
    context = contextlib.nullcontext()
    if state == "dispatch mode":
        context = _dispatch_mode()
    elif state == "function mode":
        context = _function_mode()
    elif state == "autocast to bfloat16":
        context = torch.autocast("cpu", dtype=torch.bfloat16)
    elif state == "dropout":
        kw["dropout_p"] = 0.5
    elif state == "enable_gqa False":
        kw["enable_gqa"] = False
    else:
        rdnattention.patch_sdpa(devices="cuda", strict=True)
    with context:
        if state == "enable_gqa False":  # torch refuses 4 query heads over 2 key heads without enable_gqa
            with pytest.raises(RuntimeError):
                F.scaled_dot_product_attention(q, k, v, **kw)
        elif state == "dropout":
            assert F.scaled_dot_product_attention(q, k, v, **kw).shape == q.shape
        else:
            out = F.scaled_dot_product_attention(q, k, v, **kw)
            assert out.dtype == (torch.bfloat16 if "bfloat16" in state else torch.float16)
            torch.testing.assert_close(out.float(), want, atol=3e-2 if "bfloat16" in state else 3e-3, rtol=0)
    assert rdnattention.stats()["fallbacks"] == fallbacks
