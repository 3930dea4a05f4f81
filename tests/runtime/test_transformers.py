"""The Hugging Face transformers integration: a tiny randomly initialised Llama (built from a config,
no download) generates with attn_implementation="rdnattention" the same tokens as with "sdpa", and
logits that agree to fp16 rounding, on left-padded batches with a DynamicCache and a StaticCache and
on a right-padded forward pass; a bf16 model runs the bf16 kernels; what the kernels do not cover falls back to sdpa with one warning
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


@pytest.fixture
def device(device):  # conftest's devices, with the attention function registered
    rt.register()
    return device


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


def test_a_bfloat16_model_runs_the_kernels_as_close_to_float32_as_sdpa(device):
    """bf16 weights (most checkpoints): every call runs the bf16 kernels (no fallback while it
    generates), and its logits are as close to the float32 model's as sdpa's in bf16 are, to bf16
    rounding (TOL's 4e-3 for fp16's, times 8: bf16's unit roundoff 2^-8 against fp16's 2^-11)."""
    model, model32 = _model(device, dtype=torch.bfloat16), _model(device, dtype=torch.float32)
    ids = torch.tensor([[0, 0, 5, 6, 7, 9], [1, 2, 3, 4, 5, 6]], device=device)
    mask = (ids != 0).long()
    with torch.no_grad():
        _use(model32, "sdpa")
        fp32 = model32(ids, attention_mask=mask).logits
        _use(model, "sdpa")
        base = model(ids, attention_mask=mask).logits
        _use(model, "rdnattention")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no call may fall back
            ours = model(ids, attention_mask=mask).logits
            out = _generate(model, "rdnattention", ids, mask)
    assert out.sequences.shape == (2, 6 + 8)
    valid = mask.bool()
    err = (ours[valid].float() - fp32[valid]).abs().max().item()
    base_err = (base[valid].float() - fp32[valid]).abs().max().item()
    assert err <= 2 * base_err + 8 * TOL["atol"], (err, base_err)


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
    ({"hidden": 48}, "head_dim 12"),  # 4 heads of 12: not a multiple of 8, no kernel on any target
])
def test_what_the_kernels_do_not_cover_falls_back_with_one_warning(device, model_kw, reason):
    model = _model(device, **model_kw)
    ids = torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]], device=device)
    rt.counts(reset=True)  # each reason warns again
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
    rt.counts(reset=True)  # each reason warns again
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ours = _generate(model, "rdnattention", ids, mask, cache_implementation="static")
    assert torch.equal(ours.sequences, ref.sequences)
    captured = [w for w in record if "CUDA graph is being captured" in str(w.message)]
    assert len(captured) <= 1  # once at most (if transformers captured at all)


# --- masks as a caller may build them (issue: hardening, second round) ----------------------------

def _attention_inputs(batch=3, heads=4, kv_heads=2, seq=6, d=64):
    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, heads // kv_heads
    module.eval()
    q = torch.randn(batch, heads, seq, d, generator=g).half()
    k, v = (torch.randn(batch, kv_heads, seq, d, generator=g).half() for _ in range(2))
    return module, q, k, v


# One process each: before, they read past the per-sequence lengths (an abort, or output off by 1.4
# with no warning) or wrote past the output.
_MASK_CASE = """
import warnings, torch
import rdnattention.integrations.transformers as rt
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from test_transformers import _attention_inputs
module, q, k, v = _attention_inputs()
causal = torch.ones(6, 6, dtype=torch.bool).tril()
left_padded = causal.clone()
left_padded[:, 0] = False  # every sequence: one padding token on the left
mask = {mask}
try:
    ref = sdpa_attention_forward(module, q, k, v, mask)[0]
    print("sdpa: ok")
except RuntimeError as e:
    print("sdpa: RuntimeError")
with warnings.catch_warnings():
    warnings.simplefilter("error")  # no fallback
    try:
        ours = rt.attention_forward(module, q, k, v, mask)[0]
        print("max difference", (ours.float() - ref.float()).abs().max().item())
    except rt.InvalidArgumentError as e:
        print("InvalidArgumentError:", e)
"""


@pytest.mark.parametrize("mask, expected", [
    ("left_padded[None, None]", None),  # batch 1 for a batch of 3: sdpa broadcasts it
    ("left_padded[None, None].expand(3, 1, 6, 6)", None),
    ("left_padded[None]", None),
    ("left_padded", None),
    ("torch.where(left_padded, 0.0, float('-inf')).half()[None, None]", None),
    ("torch.ones(3, 1, 9, 6, dtype=torch.bool).tril()", "attention_mask of shape (3, 1, 9, 6) does not broadcast to "
                                                        "[batch, heads, seq_q, seq_k] = [3, 4, 6, 6]"),
    ("torch.ones(3, 1, 6, 11, dtype=torch.bool).tril()", "attention_mask of shape (3, 1, 6, 11) does not broadcast"),
    ("torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()", "attention_mask of shape (2, 1, 6, 6) does not broadcast"),
    ("torch.ones(1, 3, 6, 6, dtype=torch.bool).tril()", "attention_mask of shape (1, 3, 6, 6) does not broadcast"),
])
def test_masks_sdpa_accepts_run_and_masks_it_refuses_raise(host_build, mask, expected):
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    rt.register()
    here = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_MASK_CASE.format(mask=mask))], capture_output=True,
                         text=True, timeout=300, cwd=here.parent.parent,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    if expected is None:
        assert "sdpa: ok" in out.stdout
        assert float(out.stdout.split("max difference")[1]) <= TOL["atol"], out.stdout
    else:
        assert "sdpa: RuntimeError" in out.stdout and f"InvalidArgumentError: {expected}" in out.stdout


def test_a_mask_the_kernels_do_not_read_goes_to_sdpa_counted_and_warned_once(host_build):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    module, q, k, v = _attention_inputs()
    bias = torch.randn(1, 1, 6, 6, generator=torch.Generator().manual_seed(1)).half()  # a bias, not a mask
    rt.counts(reset=True)
    reason = "an attention mask that is not causal or full over one run of valid positions per sequence"
    with pytest.warns(RuntimeWarning) as record:
        outs = [rt.attention_forward(module, q, k, v, bias)[0] for _ in range(3)]
    assert sum(reason in str(w.message) for w in record) == 1
    assert rt.counts()["fallbacks"][reason] == 3
    ref = sdpa_attention_forward(module, q, k, v, bias)[0]
    assert all(torch.equal(out, ref) for out in outs)
    # a mask of a dtype sdpa refuses: sent to sdpa, which raises as it does
    with pytest.raises(RuntimeError, match="attn_mask dtype"):
        sdpa_attention_forward(module, q, k, v, torch.ones(1, 1, 6, 6, dtype=torch.int32))
    with pytest.warns(RuntimeWarning, match="an attention mask of dtype torch.int32"):
        with pytest.raises(RuntimeError, match="attn_mask dtype"):
            rt.attention_forward(module, q, k, v, torch.ones(1, 1, 6, 6, dtype=torch.int32))
    assert rt.counts()["fallbacks"]["an attention mask of dtype torch.int32"] == 1


def test_right_padding_under_a_sliding_window_is_read_and_served(host_build):
    """Right padding (training's batches) in a sliding-window layer (Gemma 2, Mistral): the padding
    rows see the window's last valid keys, not all of them; the mask is still one run per sequence,
    served forward and backward, the valid rows as sdpa gives them, the gradients of a loss of them
    as sdpa's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    module, q, k, v = _attention_inputs(batch=2, seq=8)
    lengths = torch.tensor([5, 8])
    j, i = torch.arange(8), torch.arange(8)[:, None]
    mask = ((j < lengths[:, None, None]) & (j <= i) & (j > i - 3))[:, None]  # window of 3 keys
    rows = (torch.arange(8) < lengths[:, None])[:, :, None, None]  # [batch, seq, 1, 1]
    module.train()
    g = torch.randn(2, 8, 4, 64, generator=torch.Generator().manual_seed(2)).half() * rows

    def grads(fn):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(module, *x, mask, sliding_window=3)[0]
        (out.float() * g.float()).sum().backward()
        return out.detach() * rows, [t.grad for t in x]

    rt.counts(reset=True)
    ours, ours_grads = grads(rt.attention_forward)
    assert rt.counts()["served"] == 1 and not rt.counts()["fallbacks"]
    ref, ref_grads = grads(sdpa_attention_forward)
    torch.testing.assert_close(ours, ref, **TOL)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


def test_training_where_the_forward_has_no_kernel_falls_back_counted(host_build):
    """Inputs that require grad, with backward kernels for the head_dim but no forward kernel of the
    call's score option (the host build makes no bf16 softcap kernel at head_dim 96): the call falls
    back, counted and warned, to the attention written out, rather than raising."""
    module, q, k, v = _attention_inputs(d=96)
    q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
    module.train()
    rt.counts(reset=True)
    with pytest.warns(RuntimeWarning, match="no .*kernel for head_dim 96"):
        out = rt.attention_forward(module, q, k, v, None, softcap=5.0)[0]
    assert rt.counts()["fallback"] == 1 and rt.counts()["served"] == 0
    ref = rt._math(q, k, v, q.new_empty(0, dtype=torch.bool), True, 96 ** -0.5, 5.0, None)
    assert torch.equal(out, ref)
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_the_written_out_attention_gives_rows_that_see_no_key_zero_gradients():
    """_math (the fallback of softcaps and sinks): a row that sees no key gives zero, and its query
    zero gradient, never NaN (softmax's backward over a row of -inf is NaN)."""
    module, q, k, v = _attention_inputs()
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    mask[3] = False  # query row 3 sees no key
    out = rt._math(q, k, v, mask, True, 0.125, 5.0, None)
    assert not out[:, 3].any()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert not q.grad[:, :, 3].any() and q.grad[:, :, 2].any()


def _score_model(kind, device, sliding_window=None):
    """A tiny Gemma 2 (logit softcap) or gpt-oss (attention sinks) from a config, its sinks (gpt-oss)
    made to weigh: head_dim 64, 2 query heads per K/V head."""
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
                  sliding_window=sliding_window or 128)
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(intermediate_size=128, attn_logit_softcapping=5.0,
                                        final_logit_softcapping=None, query_pre_attn_scalar=64, **common)
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        cfg = transformers.GptOssConfig(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, **common)
        model = transformers.GptOssForCausalLM(cfg)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(2.0, 1.0)
    return model.to(device=device, dtype=torch.float16).eval()


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_softcap_and_sinks_run_the_kernels_and_match_eager(device, kind):
    """Gemma 2 passes its softcap and gpt-oss its sinks (s_aux) to the attention function: the
    kernels take them (no fallback) and the logits match transformers' eager attention, which
    applies them, on a left-padded batch and through generation with a cache."""
    model = _score_model(kind, device)
    ids = torch.tensor([[0, 0, 5, 6, 7, 9], [1, 2, 3, 4, 5, 6]], device=device)
    mask = (ids != 0).long()
    rt.counts(reset=True)
    with torch.no_grad():
        _use(model, "eager")
        ref = model(ids, attention_mask=mask).logits
        _use(model, "rdnattention")
        ours = model(ids, attention_mask=mask).logits
    assert not rt.counts()["fallbacks"], rt.counts()
    valid = mask.bool()
    torch.testing.assert_close(ours[valid], ref[valid], **TOL)
    ours_gen = _generate(model, "rdnattention", ids, mask)
    ref_gen = _generate(model, "eager", ids, mask)
    assert not rt.counts()["fallbacks"], rt.counts()
    assert torch.equal(ours_gen.sequences, ref_gen.sequences)
    for a, b in zip(ours_gen.logits, ref_gen.logits):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss"])
def test_sliding_window_layers_fall_back_to_the_transforms_written_out(device, kind):
    """A sliding window reaches the attention function as a mask the kernels do not read: such calls
    fall back with the softcap or the sinks applied (sdpa would drop them), matching eager."""
    model = _score_model(kind, device, sliding_window=3)
    ids = torch.tensor([[0, 0, 5, 6, 7, 9], [1, 2, 3, 4, 5, 6]], device=device)
    mask = (ids != 0).long()
    with torch.no_grad():
        _use(model, "eager")
        ref = model(ids, attention_mask=mask).logits
        _use(model, "rdnattention")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ours = model(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(ours[valid], ref[valid], **TOL)


def test_gpt_oss_sinks_are_trained_through_the_kernels(device):
    """Training gpt-oss (learned sinks, s_aux) on whole sequences: every attention call runs the
    kernels forward and backward, and the gradients of the sinks and of the attention weights match
    transformers' eager attention's, under fp16 autocast (fp32 weights)."""
    grads = {}
    for impl in ("rdnattention", "eager"):
        model = _score_model("gpt_oss", device).float().train()
        _use(model, impl)
        ids = torch.tensor([[1, 5, 6, 7, 9, 3], [1, 2, 3, 4, 5, 6]], device=device)
        rt.counts(reset=True)
        with torch.autocast(device.type, dtype=torch.float16):
            model(ids, labels=ids).loss.backward()
        if impl == "rdnattention":
            c = rt.counts()
            assert (c["served"], c["fallback"]) == (2, 0), c  # both layers, nothing fell back
        layer = model.model.layers[0].self_attn
        grads[impl] = (layer.sinks.grad.clone(), layer.q_proj.weight.grad.clone())
    for ours, ref in zip(grads["rdnattention"], grads["eager"]):
        assert ours.abs().max() > 0
        torch.testing.assert_close(ours, ref, atol=2e-2 * ref.abs().max().item(), rtol=0)


class _LoRA(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update (LoRA): base(x) + x A^T B^T, B zero at first."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features, device=base.weight.device) * 0.05)
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))

    def forward(self, x):
        return self.base(x) + (x @ self.a.t().to(x.dtype)) @ self.b.t().to(x.dtype)


def _lora_losses(device, impl, steps=20, batch=2, seq=32):
    """Losses of ``steps`` LoRA fine-tuning steps of a tiny random Llama (GQA 4/2, head_dim 64) under
    fp16 autocast: q_proj and v_proj adapted, everything else frozen, AdamW, the same batch each step."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).to(device)
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = _LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = _LoRA(layer.self_attn.v_proj)
    _use(model, impl)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    losses = []
    for _ in range(steps):  # one batch, learnt by heart: the loss falls
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_lora_fine_tuning_under_fp16_autocast_runs_the_backward_and_matches_sdpa(device):
    """issue 27's loop: 20 LoRA steps with attn_implementation="rdnattention" give sdpa's losses
    within fp16 tolerance, every attention call (forward and backward) run by the kernels."""
    rt.counts(reset=True)
    ours = _lora_losses(device, "rdnattention")
    c = rt.counts()
    assert (c["served"], c["fallback"]) == (20 * 2, 0), c  # 20 steps x 2 layers
    ref = _lora_losses(device, "sdpa")
    assert ours[-1] < ours[0] - 0.5, ours  # it trains
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), atol=5e-3, rtol=0)


def _padded_grads(model, impl, ids, mask):
    """The loss's gradients with respect to layer 0's q, k and v projections (and gpt-oss's sinks)
    after one step on a padded batch under fp16 autocast, the padding positions out of the loss
    (label -100, as a collator pads labels). The causal loss predicts label t + 1 from position t,
    so the first token after left padding is predicted from a padding row: its label is -100 too.
    Padding rows see no key; what attention gives there is the implementation's (zero here and in
    torch's CPU SDPA, an average over every key in eager attention; on the H200 sdpa's differed)."""
    _use(model, impl)
    model.zero_grad()
    after_padding = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], 1) == 0
    labels = ids.masked_fill((mask == 0) | after_padding, -100)
    with torch.autocast(ids.device.type, dtype=torch.float16):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    attn = model.model.layers[0].self_attn
    grads = [attn.q_proj.weight.grad, attn.k_proj.weight.grad, attn.v_proj.weight.grad]
    if getattr(attn, "sinks", None) is not None:
        grads.append(attn.sinks.grad)
    return [g.clone() for g in grads]


@pytest.mark.parametrize("kind,padding", [("llama", "left"), ("llama", "right"), ("gpt_oss", "left")])
def test_training_on_a_padded_batch_runs_the_kernels(device, kind, padding):
    """A padded batch that requires grad (fine-tuning with a padding collator): every attention call
    runs the kernels forward and backward, the valid rows packed into sequences
    (flash_attn_varlen_func), and the gradients of the attention weights (and gpt-oss's learned
    sinks) match sdpa's (eager's with sinks) within fp16 rounding; fp32 weights, fp16 autocast."""
    model = (_model(device) if kind == "llama" else _score_model(kind, device)).float().train()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 3], [1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 9, 4, 2]], device=device)
    if padding == "right":
        ids = torch.stack([torch.cat([r[r != 0], r[r == 0]]) for r in ids])
    mask = (ids != 0).long()
    rt.counts(reset=True)
    ours = _padded_grads(model, "rdnattention", ids, mask)
    c = rt.counts()
    assert (c["served"], c["fallback"]) == (2, 0), c  # both layers, nothing fell back
    ref = _padded_grads(model, "sdpa" if kind == "llama" else "eager", ids, mask)
    for a, b in zip(ours, ref):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max().item(), rtol=0)


@pytest.mark.parametrize("left,softcap", [(-1, 0.0), (2, 0.0), (-1, 3.0)])
def test_padded_training_packs_only_the_valid_rows(host_build, left, softcap):
    """The packed path itself, against the float64 oracle per sequence: a causal GQA batch of left
    and right padding, a sequence with more keys than queries and one of padding alone; plain, with
    a sliding window of ``left`` keys before the diagonal, or with a softcap. The padding rows are
    zero and get no gradient; the gradients of the valid rows are the oracle's."""
    from rdnattention import reference
    torch.manual_seed(0)
    batch, heads, heads_kv, seq_q, seq_k, d = 4, 4, 2, 5, 7, 64
    q = torch.randn(batch, heads, seq_q, d, dtype=torch.float16, requires_grad=True)
    k = torch.randn(batch, heads_kv, seq_k, d, dtype=torch.float16, requires_grad=True)
    v = torch.randn(batch, heads_kv, seq_k, d, dtype=torch.float16, requires_grad=True)
    # (first query row, query rows, first key, keys) per sequence
    runs = [(2, 3, 3, 4), (0, 5, 0, 7), (0, 0, 0, 0), (0, 2, 0, 5)]  # the third all padding
    q0, sq, k0, n = (torch.tensor(c, dtype=torch.int32) for c in zip(*runs))
    out = rt._packed_trainable(q, k, v, (q0, sq, k0, n), True, d ** -0.5, left, {"softcap": softcap})
    grad = torch.randn_like(out)
    out.backward(grad)
    for b, (a, m, c, l) in enumerate(runs):
        if m == 0:
            assert not out[b].any() and not q.grad[b].any() and not k.grad[b].any() and not v.grad[b].any()
            continue
        qs, ks, vs = q[b:b + 1, :, a:a + m], k[b:b + 1, :, c:c + l], v[b:b + 1, :, c:c + l]
        dout = grad[b:b + 1, a:a + m].transpose(1, 2)
        opts = dict(is_causal=True, window_size=(left, 0), softmax_scale=d ** -0.5, softcap=softcap)
        ref = reference.attention_reference(qs, ks, vs, **opts)
        grads = reference.attention_gradients(qs, ks, vs, dout, **opts)
        torch.testing.assert_close(out[b, a:a + m].double(), ref[0].transpose(0, 1), atol=2e-3, rtol=0)
        for ours, theirs, lo, hi in zip((q, k, v), grads, (a, c, c), (a + m, c + l, c + l)):
            torch.testing.assert_close(ours.grad[b, :, lo:hi].double(), theirs[0], atol=1e-2, rtol=0)
            outside = torch.ones(ours.shape[2], dtype=torch.bool)
            outside[lo:hi] = False
            assert not ours.grad[b, :, outside].any()
        padding_rows = torch.ones(seq_q, dtype=torch.bool)
        padding_rows[a:a + m] = False
        assert not out[b, padding_rows].any()


def test_a_repeated_call_replays_and_what_its_key_does_not_hold_takes_the_full_path(host_build, monkeypatch):
    """A second unmasked call of one geometry replays its plan before any of attention_forward's
    checks, bit for bit the first's output; dropout while training, autocast, attention outputs,
    sinks and a softcap of the wrong type still take the full path (a fallback, or the error sdpa
    raises), exactly as the first call of the geometry does."""
    from rdnattention import ops
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    module, q, k, v = _attention_inputs(seq=1)
    k, v = (torch.randn(3, 2, 40, 64, generator=torch.Generator().manual_seed(s)).half() for s in (2, 3))
    first = rt.attention_forward(module, q, k, v, None, scaling=0.125)[0]
    planned = []

    class Planned(Exception):
        pass

    def forward(*args, **kwargs):
        planned.append(1)
        raise Planned

    monkeypatch.setattr(ops, "forward", forward)
    before = rt.counts()["served"]
    again = rt.attention_forward(module, q, k, v, None, scaling=0.125)[0]
    assert torch.equal(again, first) and not planned and rt.counts()["served"] == before + 1
    assert (again.shape, again.stride()) == (first.shape, first.stride())  # token-major, contiguous
    ref = sdpa_attention_forward(module, q, k, v, None, scaling=0.125)[0]
    assert (first.float() - ref.float()).abs().max() <= TOL["atol"]

    rt.counts(reset=True)
    module.train()
    with pytest.warns(RuntimeWarning, match="dropout 0.5 while training"):
        rt.attention_forward(module, q, k, v, None, dropout=0.5, scaling=0.125)
    module.eval()
    with pytest.warns(RuntimeWarning, match="output_attentions"):
        rt.attention_forward(module, q, k, v, None, scaling=0.125, output_attentions=True)
    with pytest.warns(RuntimeWarning, match="softcap"):
        rt.attention_forward(module, q, k, v, None, scaling=0.125, softcap="5")
    assert set(rt.counts()["fallbacks"]) == {"dropout 0.5 while training: the kernels have no attention dropout",
                                             "output_attentions: the attention weights are never materialised",
                                             *(r for r in rt.counts()["fallbacks"] if "softcap" in r)}
    assert rt.counts()["served"] == 0 and not planned
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(Planned):  # sdpa's autocast rule: bf16, planned
        rt.attention_forward(module, q.float(), k.float(), v.float(), None, scaling=0.125)
    with torch.autocast("cpu", dtype=torch.float16):  # autocast's checks, then the same tensors: replayed
        assert torch.equal(rt.attention_forward(module, q, k, v, None, scaling=0.125)[0], first)
    assert planned == [1]
