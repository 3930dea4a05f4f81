"""The Hugging Face transformers integration: a tiny randomly initialised Llama (built from a config,
no download) generates with attn_implementation="rdnattention" the same tokens as with "sdpa", and
logits that agree to fp16 rounding, on left-padded batches with a DynamicCache and a StaticCache and
on a right-padded forward pass; what the kernels do not cover falls back to sdpa with one warning
per reason. On the host platform, and on an NVIDIA GPU where one is present."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
rt = pytest.importorskip("rdnattention.integrations.transformers")

# Logits of the tiny model are O(1); fp16 rounds them to about 1e-3, and the two attention
# implementations round differently.
TOL = dict(atol=4e-3, rtol=4e-3)


def _model(device, hidden=256, heads=4, kv_heads=2, dtype=torch.float16):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads,
                                   max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _use(model, impl):
    model.config._attn_implementation = impl
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = impl


def _generate(model, impl, ids, mask, **kw):
    _use(model, impl)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True, **kw)


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=_devices())
def device(request):
    if request.param == "cuda":
        if not torch.cuda.is_available() or torch.version.hip is not None:
            pytest.skip("needs an NVIDIA GPU")
    else:
        request.getfixturevalue("host_build")
    rt.register()
    return torch.device(request.param)


@pytest.mark.parametrize("cache", [None, "static"])
def test_generate_on_a_left_padded_batch_matches_sdpa(device, cache):
    model = _model(device)
    ids = torch.tensor([[0, 0, 5, 6, 7, 9], [1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 8, 3]], device=device)
    mask = (ids != 0).long()
    mask[1] = 1
    # Eager generation: compiled StaticCache generation captures CUDA graphs, where the mask cannot
    # be read and the calls fall back (test_compiled_static_generation_falls_back_under_capture).
    kw = {"cache_implementation": cache, "disable_compile": True} if cache else {}
    ref = _generate(model, "sdpa", ids, mask, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no call may fall back
        ours = _generate(model, "rdnattention", ids, mask, **kw)
    assert torch.equal(ours.sequences, ref.sequences)
    for a, b in zip(ours.logits, ref.logits):
        torch.testing.assert_close(a, b, **TOL)


def test_a_right_padded_forward_matches_sdpa_where_tokens_are(device):
    model = _model(device)
    ids = torch.tensor([[5, 6, 7, 9, 0, 0], [1, 2, 3, 4, 5, 6]], device=device)
    mask = (ids != 0).long()
    with torch.no_grad():
        _use(model, "sdpa")
        ref = model(ids, attention_mask=mask).logits
        _use(model, "rdnattention")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(ours[valid], ref[valid], **TOL)


@pytest.mark.parametrize("model_kw, reason", [
    ({"dtype": torch.float32}, "dtype torch.float32"),
    ({"hidden": 128}, "head_dim 32"),  # 4 heads of 32: no kernel built for head_dim 32's decode
])
def test_what_the_kernels_do_not_cover_falls_back_with_one_warning(device, model_kw, reason):
    model = _model(device, **model_kw)
    ids = torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]], device=device)
    rt._warned.clear()
    with pytest.warns(RuntimeWarning, match=f"rdnattention: .*{reason}") as record:
        ours = _generate(model, "rdnattention", ids, (ids != 0).long())
    assert sum(reason in str(w.message) for w in record) == 1
    ref = _generate(model, "sdpa", ids, (ids != 0).long())
    assert torch.equal(ours.sequences, ref.sequences)


@pytest.mark.gpu
def test_compiled_static_generation_falls_back_under_capture():
    if not torch.cuda.is_available() or torch.version.hip is not None:
        pytest.skip("needs an NVIDIA GPU")
    rt.register()
    device = torch.device("cuda")
    model = _model(device)
    ids = torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]], device=device)
    mask = (ids != 0).long()
    ref = _generate(model, "sdpa", ids, mask, cache_implementation="static")
    rt._warned.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = _generate(model, "rdnattention", ids, mask, cache_implementation="static")
    assert torch.equal(ours.sequences, ref.sequences)
    captured = [w for w in record if "CUDA graph is being captured" in str(w.message)]
    assert len(captured) <= 1  # once at most (if transformers captured at all)
