"""Software that calls torch's SDPA, run with rdnattention.patch_sdpa on the host emulator (and on
an NVIDIA GPU where one is present): torch's nn.MultiheadAttention, a tiny transformers Llama
(attn_implementation="sdpa"), and diffusers' UNet2DConditionModel and a Flux transformer block
where diffusers is installed. Random weights from configs, nothing downloaded. Each is compared
with the unpatched model (in float32 where fp16 rounding of the unpatched model is the yardstick),
and stats() must count every attention call: served by the kernels, or run by torch for a stated
reason."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import rdnattention
from rdnattention import route
from rdnattention.call import Layout, Precision, Request
from rdnattention.integrations import sdpa as patch

ORIGINAL = F.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _never_left_patched(sdpa_restored):  # conftest: unpatched after every test
    yield


@pytest.fixture
def patched(device):
    """Patched for the device's tensors, strict (an error after a call was found servable propagates)."""
    rdnattention.patch_sdpa(devices=device.type, strict=True)
    rdnattention.stats(reset=True)
    yield device
    rdnattention.unpatch_sdpa()


def _counts():
    s = rdnattention.stats(reset=True)
    return s["served"], s["fallbacks"]


def _unpatched(fn):
    """``fn()`` with torch's own SDPA; patched as before afterwards."""
    config = patch._config
    rdnattention.unpatch_sdpa()
    try:
        return fn()
    finally:
        rdnattention.patch_sdpa(devices=config.devices, device_masks=config.device_masks, strict=config.strict)


def _served_head_dim(device, head_dim: int) -> bool:
    table = route.device_table(device)
    try:
        route.choose(table, Request(precision=Precision.FP16, layout=Layout.STRIDED, head_dim=head_dim, rows=64))
        return True
    except rdnattention.UnsupportedError:
        return False


def _close_to_float32(ours, fp16, fp32, slack=2e-3):
    """The patched fp16 model is as close to float32 as the unpatched fp16 model, to fp16 rounding."""
    err = (ours.float() - fp32).abs().max().item()
    base = (fp16.float() - fp32).abs().max().item()
    assert err <= 2 * base + slack, (err, base)


# --- nn.MultiheadAttention -------------------------------------------------------------------------

L, BATCH = 24, 2
CAUSAL = torch.ones(L, L, dtype=torch.bool).triu(1)  # nn.MultiheadAttention's bool masks: True hides
PADDING = torch.arange(L)[None, :] >= torch.tensor([L, 15])[:, None]  # sequence 1 has 15 real keys


def _mha(embed, heads, batch_first=False):
    torch.manual_seed(0)
    return nn.MultiheadAttention(embed, heads, batch_first=batch_first).eval()


@pytest.mark.parametrize("masks", [{}, {"key_padding_mask": PADDING}, {"attn_mask": CAUSAL},
                                   {"attn_mask": CAUSAL, "is_causal": True},
                                   {"attn_mask": CAUSAL, "key_padding_mask": PADDING}],
                         ids=["no mask", "key padding", "causal", "is_causal", "causal and key padding"])
def test_multihead_attention_is_served(patched, masks):
    dev = patched
    m32 = _mha(128, 4).to(dev)  # head_dim 32
    m16 = _mha(128, 4).half().to(dev)
    x = torch.randn(L, BATCH, 128, device=dev)
    masks = {name: m.to(dev) if isinstance(m, torch.Tensor) else m for name, m in masks.items()}
    with torch.no_grad():
        ours = m16(x.half(), x.half(), x.half(), need_weights=False, **masks)[0]
        assert _counts() == (1, {})
        fp16 = _unpatched(lambda: m16(x.half(), x.half(), x.half(), need_weights=False, **masks)[0])
        fp32 = _unpatched(lambda: m32(x, x, x, need_weights=False, **masks)[0])
    valid = ~PADDING.T[:, :, None].to(dev).expand_as(fp32) if "key_padding_mask" in masks else slice(None)
    _close_to_float32(ours[valid], fp16[valid], fp32[valid])


def test_multihead_attention_trains_with_key_padding_in_one_call(patched, monkeypatch):
    """Training through nn.MultiheadAttention with a key padding mask (head_dim 64, which has backward
    kernels; fp32 weights under fp16 autocast): one call with the sequences' key counts, forward and
    backward, no call per sequence; the weights' gradients are as close to float32's as torch's own under
    autocast, to fp16 rounding."""
    dev = patched
    monkeypatch.setattr(patch._Run, "_one", lambda *a: pytest.fail("a call per sequence"))
    x = torch.randn(L, BATCH, 128, device=dev)
    g = torch.randn(L, BATCH, 128, device=dev)
    padding = PADDING.to(dev)

    def grads(autocast: bool):
        m = _mha(128, 2).to(dev).train()
        with torch.autocast(dev.type, dtype=torch.float16, enabled=autocast):
            out = m(x, x, x, need_weights=False, key_padding_mask=padding)[0]
        out.float().backward(g)
        return m.in_proj_weight.grad

    ours = grads(True)
    assert _counts() == (1, {})
    fp16 = _unpatched(lambda: grads(True))
    fp32 = _unpatched(lambda: grads(False))
    assert fp32.abs().max() > 0
    _close_to_float32(ours, fp16, fp32)


def test_multihead_attention_of_head_dim_12_runs_torchs_function(patched):
    dev = patched
    m = _mha(48, 4).half().to(dev)  # head_dim 12: not a multiple of 8, no kernel on any target
    x, causal = torch.randn(L, BATCH, 48, device=dev).half(), CAUSAL.to(dev)
    with torch.no_grad():
        ours = m(x, x, x, need_weights=False, attn_mask=causal)[0]
        assert _counts() == (0, {"head_dim 12": 1})
        assert torch.equal(ours, _unpatched(lambda: m(x, x, x, need_weights=False, attn_mask=causal)[0]))


def test_multihead_attention_of_head_dim_16_is_served_where_built_else_runs_torchs_function(patched):
    dev = patched
    m = _mha(64, 4).half().to(dev)  # head_dim 16: built for GPUs, not by the host target
    x, causal = torch.randn(L, BATCH, 64, device=dev).half(), CAUSAL.to(dev)
    with torch.no_grad():
        ours = m(x, x, x, need_weights=False, attn_mask=causal)[0]
        ref = _unpatched(lambda: m(x, x, x, need_weights=False, attn_mask=causal)[0])
    if _served_head_dim(dev, 16):
        assert _counts() == (1, {})
        torch.testing.assert_close(ours, ref, atol=2e-3, rtol=2e-3)
    else:
        assert _counts() == (0, {"head_dim 16": 1})
        assert torch.equal(ours, ref)


def test_multihead_attentions_fast_path_does_not_call_sdpa_unless_disabled(patched):
    # Batch-first self-attention in inference runs torch's fused C++ path, which never looks up
    # F.scaled_dot_product_attention; with the fast path off it does, and is served.
    m = _mha(128, 4, batch_first=True).half().to(patched)
    x = torch.randn(BATCH, L, 128, device=patched).half()
    with torch.no_grad():
        fast = m(x, x, x, need_weights=False)[0]
        assert _counts() == (0, {})
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            ours = m(x, x, x, need_weights=False)[0]
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    assert _counts() == (1, {})
    torch.testing.assert_close(ours, fast, atol=2e-3, rtol=2e-3)


# --- transformers ----------------------------------------------------------------------------------


def _llama(device, dtype=torch.float16):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


IDS = torch.tensor([[0, 0, 5, 6, 7, 9], [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 8, 3]])
NEW_TOKENS = 8


def _generate(model, **kw):
    ids = IDS.to(model.device)
    mask = (ids != 0).long()
    mask[1] = 1
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("cache", [None, "static"])
def test_llama_generates_through_the_patch(patched, cache):
    model = _llama(patched)
    kw = {"cache_implementation": cache, "disable_compile": True} if cache else {}
    ours = _generate(model, **kw)
    # Every layer's attention of every forward pass (a left-padded prefill, then one per new token).
    assert _counts() == (model.config.num_hidden_layers * NEW_TOKENS, {})
    ref = _unpatched(lambda: _generate(model, **kw))
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=4e-3, rtol=4e-3)


def test_llama_prefill_without_padding_is_causal(patched):
    model, model32 = _llama(patched), _llama(patched, torch.float32)
    ids = IDS[1:].to(patched)
    with torch.no_grad():
        ours = model(ids).logits
        assert _counts() == (model.config.num_hidden_layers, {})
        fp16 = _unpatched(lambda: model(ids).logits)
        fp32 = _unpatched(lambda: model32(ids).logits)
    _close_to_float32(ours, fp16, fp32)


def test_a_bfloat16_llama_is_served(patched):
    """bf16 weights, as most checkpoints ship: every attention call of a left-padded generation is
    served (2 layers x 8 forward passes: 16 of 16), and the prefill's logits are as close to the
    float32 model's as torch's bf16 attention gives, to bf16 rounding (8x fp16's slack: bf16's unit
    roundoff 2^-8 against fp16's 2^-11)."""
    model, model32 = _llama(patched, torch.bfloat16), _llama(patched, torch.float32)
    _generate(model)
    assert _counts() == (model.config.num_hidden_layers * NEW_TOKENS, {})
    ids = IDS[1:].to(patched)
    with torch.no_grad():
        ours = model(ids).logits
        assert _counts() == (model.config.num_hidden_layers, {})
        bf16 = _unpatched(lambda: model(ids).logits)
        fp32 = _unpatched(lambda: model32(ids).logits)
    _close_to_float32(ours, bf16, fp32, slack=8 * 2e-3)


def test_a_float32_llama_runs_torchs_function_counted(patched):
    model = _llama(patched, torch.float32)
    ours = _generate(model)
    assert _counts() == (0, {"dtype torch.float32": model.config.num_hidden_layers * NEW_TOKENS})
    assert torch.equal(ours.sequences, _unpatched(lambda: _generate(model)).sequences)


# --- diffusers -------------------------------------------------------------------------------------


def _unet(channels, down, up, heads, groups):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=channels,
        down_block_types=down, up_block_types=up, cross_attention_dim=32, attention_head_dim=heads,
        norm_num_groups=groups).eval()


UNETS = {
    # head_dim 32 and 64 (the mid block's)
    "small": ((64, 128), ("CrossAttnDownBlock2D", "DownBlock2D"), ("UpBlock2D", "CrossAttnUpBlock2D"), 2, 32),
    # Stable Diffusion 1.5's geometry at a fraction of its width: head_dim 40, 80 and 160
    "sd15 geometry": ((80, 160, 320), ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                      ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), 2, 16),
}


@pytest.mark.parametrize("name", list(UNETS))
@pytest.mark.parametrize("text_mask", [False, True], ids=["", "encoder_attention_mask"])
def test_unet2dcondition_step_through_the_patch(patched, name, text_mask):
    pytest.importorskip("diffusers")
    from diffusers.models.attention_processor import Attention

    dev = patched
    unet = _unet(*UNETS[name]).to(dev)
    x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 7, 32)
    x, t, text = x.to(dev), t.to(dev), text.to(dev)
    kw = {"encoder_attention_mask": torch.tensor([[1] * 7, [1] * 4 + [0] * 3], device=dev)} if text_mask else {}
    with torch.no_grad():
        fp32 = _unpatched(lambda: unet(x, t, text, **kw).sample)
        unet.half()
        ours = unet(x.half(), t, text.half(), **kw).sample
        served, fallbacks = _counts()
        fp16 = _unpatched(lambda: unet(x.half(), t, text.half(), **kw).sample)
    _close_to_float32(ours, fp16, fp32)
    # One call per attention module per step, every one served: head_dims 32 and 64, and SD 1.5's
    # 40, 80 and 160, are built for every target.
    head_dims = {m.to_q.out_features // m.heads for m in unet.modules() if isinstance(m, Attention)}
    assert head_dims == ({32, 64} if name == "small" else {40, 80, 160})
    assert all(_served_head_dim(dev, d) for d in head_dims)
    assert (served, fallbacks) == (sum(isinstance(m, Attention) for m in unet.modules()), {})


def test_unet2dcondition_trains_through_the_patch(patched):
    """A training step of Stable Diffusion 1.5's UNet geometry (head_dim 40, 80 and 160, the
    backward kernels of SD 1.5 LoRA training; fp32 weights under fp16 autocast): every attention
    call served, forward and backward, none run by torch; the attention projections' gradients are
    as close to float32's as torch's own under autocast, to fp16 rounding."""
    pytest.importorskip("diffusers")
    from diffusers.models.attention_processor import Attention

    dev = patched
    x, t, text = torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 7, 32)
    x, t, text = x.to(dev), t.to(dev), text.to(dev)
    noise = torch.randn(2, 4, 8, 8).to(dev)

    def grads(autocast: bool):
        unet = _unet(*UNETS["sd15 geometry"]).to(dev).train()
        with torch.autocast(dev.type, dtype=torch.float16, enabled=autocast):
            pred = unet(x, t, text).sample
        F.mse_loss(pred.float(), noise).backward()
        return torch.cat([p.grad.flatten() for m in unet.modules() if isinstance(m, Attention)
                          for p in (m.to_q.weight, m.to_k.weight, m.to_v.weight)])

    ours = grads(True)
    served, fallbacks = _counts()
    modules = sum(isinstance(m, Attention) for m in _unet(*UNETS["sd15 geometry"]).modules())
    assert (served, fallbacks) == (modules, {})
    fp16 = _unpatched(lambda: grads(True))
    fp32 = _unpatched(lambda: grads(False))
    assert fp32.abs().max() > 0
    _close_to_float32(ours, fp16, fp32)


def test_flux_transformer_block_through_the_patch(patched):
    pytest.importorskip("diffusers")
    from diffusers.models.embeddings import get_1d_rotary_pos_embed
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    torch.manual_seed(0)
    dev = patched
    block = FluxTransformerBlock(dim=128, num_attention_heads=2, attention_head_dim=64).eval().to(dev)
    image, text, temb = (torch.randn(*shape).to(dev) for shape in ((2, 16, 128), (2, 8, 128), (2, 128)))
    # cos and sin of the text and image tokens
    rope = tuple(t.to(dev) for t in get_1d_rotary_pos_embed(64, 24, use_real=True, repeat_interleave_real=True))
    with torch.no_grad():
        fp32 = _unpatched(lambda: block(image, text, temb, image_rotary_emb=rope))
        block.half()
        ours = block(image.half(), text.half(), temb.half(), image_rotary_emb=rope)
        assert _counts() == (1, {})  # one joint attention over text and image tokens
        fp16 = _unpatched(lambda: block(image.half(), text.half(), temb.half(), image_rotary_emb=rope))
    for a, b, c in zip(ours, fp16, fp32):
        _close_to_float32(a, b, c)
