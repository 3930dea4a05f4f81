"""Transformer models that call attention through transformers' interfaces, run on rdnattention's
kernels two ways: through the SDPA patch (attn_implementation="sdpa", rdnattention.patch_sdpa)
and through rdnattention's own transformers integration (register(), attn_implementation=
"rdnattention"). Tiny configs with random weights (nothing downloaded): Qwen2 (GQA, biased
projections), Mistral with a sliding window shorter than the sequence, Phi-3 (head_dim 96), and
timm's ViT where timm is installed. A left-padded forward pass is compared with the unpatched
model in float32 (the fp16 model's own rounding is the yardstick), and generate() (slow) with the
unpatched fp16 model's tokens and logits; rdnattention.stats() must count every attention call as
served by the kernels, except where the target builds no kernel for it (then counted under the
chooser's reason).""" 

import pytest
import torch
import torch.nn.functional as F

import rdnattention
from rdnattention import route
from rdnattention.call import Layout, Option, Precision, Request

transformers = pytest.importorskip("transformers")
rt = pytest.importorskip("rdnattention.integrations.transformers")

ORIGINAL = F.scaled_dot_product_attention
LAYERS = 2
NEW_TOKENS = 4


@pytest.fixture(autouse=True)
def _never_left_patched(sdpa_restored):  # conftest: unpatched after every test
    yield


def _qwen2(**kw):
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, **kw))


def _mistral(**kw):  # a window of 4 keys over sequences of 8 and more
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=64, sliding_window=4, **kw))


def _phi3(**kw):  # head_dim 96
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=128, hidden_size=384, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0, **kw))


MODELS = {"qwen2": _qwen2, "mistral sliding window": _mistral, "phi3 head_dim 96": _phi3}
IDS = torch.tensor([[0, 0, 5, 6, 7, 9, 11, 3, 4, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
MASK = (IDS != 0).long()


def _models(name: str, impl: str, device: torch.device):
    """The model in float32 and float16, one set of weights, attention through ``impl``."""
    torch.manual_seed(0)
    m32 = MODELS[name](attn_implementation=impl).to(device).eval()
    torch.manual_seed(0)
    m16 = MODELS[name](attn_implementation=impl).to(device=device, dtype=torch.float16).eval()
    return m32, m16


class _Route:
    """Attention through the SDPA patch ("sdpa") or through register() ("rdnattention"), switched
    off (torch's SDPA, transformers' sdpa attention) for the references."""

    def __init__(self, how: str, device: torch.device):
        self.how, self.device = how, device
        self.impl = "sdpa" if how == "patch" else rt.register()

    def on(self, model):
        if self.how == "patch":
            rdnattention.patch_sdpa(devices=self.device.type, strict=True)
        else:
            model.set_attn_implementation(self.impl)
        rdnattention.stats(reset=True)

    def off(self, model):
        rdnattention.unpatch_sdpa()
        if self.how != "patch":
            model.set_attn_implementation("sdpa")

    def expected(self, model, calls: int):
        """(served, fallbacks) of ``calls`` attention calls: all served, except where the target
        builds no kernel for them. register() runs padded batches on the split-KV kernels (per-
        sequence query rows), which the host target builds at fewer head_dims than the row-block
        ones; those calls run transformers' sdpa attention, counted under the chooser's reason."""
        if self.how == "patch":
            return calls, {}
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        request = Request(precision=Precision.FP16, layout=Layout.PACKED, head_dim=head_dim, rows=1,
                          options=frozenset({Option.QUERY_COUNTS}))
        try:
            route.choose(route.device_table(self.device), request)
        except rdnattention.UnsupportedError as e:
            return 0, {str(e): calls}
        return calls, {}

    def counts(self):
        s = rdnattention.stats(reset=True)
        if self.how == "patch":
            assert s["transformers"]["served"] == 0
            return s["served"], s["fallbacks"]
        assert s["served"] == s["fallback"] == 0
        return s["transformers"]["served"], s["transformers"]["fallbacks"]


def _close_to_float32(ours, fp16, fp32, slack=2e-3):
    """The fp16 model on the kernels is as close to float32 as the fp16 model on torch, to fp16 rounding."""
    err = (ours.float() - fp32).abs().max().item()
    base = (fp16.float() - fp32).abs().max().item()
    assert err <= 2 * base + slack, (err, base)


def _generate(model, ids, mask):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("how", ["patch", "register"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_left_padded_forward_is_the_float32_models(device, name, how):
    route = _Route(how, device)
    m32, m16 = _models(name, "sdpa", device)
    ids, mask = IDS.to(device), MASK.to(device)
    valid = mask.bool()
    with torch.no_grad():
        fp32 = m32(ids, attention_mask=mask).logits
        fp16 = m16(ids, attention_mask=mask).logits
        route.on(m16)
        ours = m16(ids, attention_mask=mask).logits
    assert route.counts() == route.expected(m16, LAYERS)  # one call per layer
    if how == "patch" or device.type == "cuda":
        assert route.expected(m16, 1) == (1, {})  # served whole: every head_dim is built for GPUs
    _close_to_float32(ours[valid], fp16[valid], fp32[valid])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["patch", "register"])
@pytest.mark.parametrize("name", list(MODELS))
def test_generate_is_the_unpatched_models(device, name, how):
    route = _Route(how, device)
    _, m16 = _models(name, "sdpa", device)
    ids, mask = IDS.to(device), MASK.to(device)
    route.on(m16)
    ours = _generate(m16, ids, mask)
    assert route.counts() == route.expected(m16, LAYERS * NEW_TOKENS)  # the prefill, then one pass per new token
    route.off(m16)
    ref = _generate(m16, ids, mask)
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=4e-3, rtol=4e-3)


def test_vit_of_timm_through_the_patch(device):
    timm = pytest.importorskip("timm", reason="timm is not installed")
    torch.manual_seed(0)
    kw = dict(img_size=32, patch_size=8, embed_dim=128, depth=2, num_heads=2, num_classes=10)
    m32 = timm.models.vision_transformer.VisionTransformer(**kw).to(device).eval()
    m16 = timm.models.vision_transformer.VisionTransformer(**kw).to(device).eval()
    m16.load_state_dict(m32.state_dict())
    m16.half()
    x = torch.randn(2, 3, 32, 32, device=device)
    with torch.no_grad():
        fp32 = m32(x)
        fp16 = m16(x.half())
        rdnattention.patch_sdpa(devices=device.type, strict=True)
        rdnattention.stats(reset=True)
        ours = m16(x.half())
    s = rdnattention.stats(reset=True)
    assert (s["served"], s["fallbacks"]) == (2, {})  # one attention per block
    _close_to_float32(ours, fp16, fp32)
