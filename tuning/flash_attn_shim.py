"""What the ``flash_attn`` import shim of ``tuning.flash_attn_tests`` serves: flash-attn's public
names mapped to rdnattention's entry points, and the helpers flash-attn's test file imports
(``bert_padding.pad_input``/``unpad_input``, ``layers.rotary.apply_rotary_emb``), written here in
plain torch from their documented semantics.

Gradients are rdnattention's own wherever it has them (``flash_attn_func``,
``flash_attn_varlen_func`` and their packed forms, through autograd). Where a call with
grad-requiring inputs is refused (``flash_attn_with_kvcache`` and paged packed sequences have no
backward pass; a head_dim or dtype without a backward kernel),
the shim records the refusal and runs the forward alone under ``torch.autograd.Function`` (grad
mode off inside), whose backward returns NaN placeholders (PlaceholderGrad), so the forward checks
of a test that also asks for gradients still run. The harness then tells a failed statement about
a placeholder gradient (backward not served, with the refusal as its reason) from one about the
forward output. A forward the kernels refuse as well is refused as it is."""

from __future__ import annotations

import functools

import torch

import rdnattention
from rdnattention.errors import UnsupportedError

USE_TRITON_ROCM = False


class PlaceholderGrad(torch.Tensor):
    """A NaN placeholder gradient. torch ops on it return this type, so the gradients a test derives
    from it (padded, rearranged, unbound) stay recognisable; a leaf's accumulated ``.grad`` is a
    plain tensor (the harness recognises it as all NaN)."""


class State:
    """Per-case bookkeeping, reset by the harness before each case."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.forward_calls = 0     # entry-point calls through the shim
        self.backward_calls = 0    # backward requests on an output of a forward-only call
        self.refusals: list[str] = []  # why each forward-only call's backward is not served
        self.placeholders: list[torch.Tensor] = []  # kept alive so their storages are not reused in the case
        self._storages: set[int] = set()

    def placeholder(self, shape, dtype, device) -> torch.Tensor:
        t = torch.full(shape, float("nan"), dtype=dtype, device=device).as_subclass(PlaceholderGrad)
        self.placeholders.append(t)
        self._storages.add(t.untyped_storage().data_ptr())
        return t

    def is_placeholder(self, t: torch.Tensor) -> bool:
        """``t`` is a NaN placeholder gradient, one derived from it by torch ops, or a view of one."""
        if isinstance(t, PlaceholderGrad):
            return True
        try:
            return t.untyped_storage().data_ptr() in self._storages
        except (RuntimeError, NotImplementedError):
            return False


STATE = State()


class _ForwardOnly(torch.autograd.Function):
    """Runs ``thunk`` (an rdnattention entry point over the original arguments) with grad mode off;
    its outputs are connected to the grad-requiring ``inputs`` and their backward returns NaN
    placeholders. Non-tensor outputs pass through; tensor outputs after the first (the lse) are not
    differentiable."""

    @staticmethod
    def forward(ctx, thunk, *inputs):
        result = thunk()
        outs = result if isinstance(result, tuple) else (result,)
        ctx.metas = [(t.shape, t.dtype, t.device) for t in inputs]
        tensors = [o for o in outs if isinstance(o, torch.Tensor)]
        if len(tensors) > 1:
            ctx.mark_non_differentiable(*tensors[1:])
        ctx.single = not isinstance(result, tuple)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        STATE.backward_calls += 1
        return (None, *(STATE.placeholder(*meta) for meta in ctx.metas))


def _grad_inputs(args, kwargs) -> list[torch.Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]


def _serve(fn):
    """``fn`` as the shim's name: called as it is, rdnattention's backward included; where a call with
    grad-requiring inputs (grad mode on) is refused, its forward alone through _ForwardOnly, the
    refusal recorded in STATE."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        STATE.forward_calls += 1
        inputs = _grad_inputs(args, kwargs)
        if not (torch.is_grad_enabled() and inputs):
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except UnsupportedError as e:  # a refused call changed nothing: run its forward alone
            refusal = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        result = _ForwardOnly.apply(lambda: fn(*args, **kwargs), *inputs)  # a refused forward raises here
        STATE.refusals.append(refusal)
        return result[0] if isinstance(result, tuple) and len(result) == 1 else result

    return call


flash_attn_func = _serve(rdnattention.flash_attn_func)
flash_attn_kvpacked_func = _serve(rdnattention.flash_attn_kvpacked_func)
flash_attn_qkvpacked_func = _serve(rdnattention.flash_attn_qkvpacked_func)
flash_attn_varlen_func = _serve(rdnattention.flash_attn_varlen_func)
flash_attn_varlen_kvpacked_func = _serve(rdnattention.flash_attn_varlen_kvpacked_func)
flash_attn_varlen_qkvpacked_func = _serve(rdnattention.flash_attn_varlen_qkvpacked_func)
flash_attn_with_kvcache = _serve(rdnattention.flash_attn_with_kvcache)

ENTRY_POINTS = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
                "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache")


def _get_block_size_n(device, head_dim, is_dropout, causal) -> int:
    """flash-attn's key-block size, which its tests use only to decode the dropout-encoded
    attention matrix (``S_dmask``) of a dropout run. rdnattention has no dropout (dropout_p > 0 is
    refused before any such decoding) and returns no ``S_dmask``, so any block size serves; 128
    is returned."""
    return 128


# bert_padding ---------------------------------------------------------------------------------------------------

def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """hidden_states [batch, seqlen, ...] and a bool mask [batch, seqlen] (True: a token) ->
    (the selected tokens [total, ...] in batch-then-position order, their indices into the
    flattened [batch * seqlen] tokens, cu_seqlens int32 [batch + 1], the longest sequence as an
    int, and the tokens used per sequence int32 [batch]). ``unused_mask`` marks tokens that are
    kept in the output (and counted in the cumulative lengths) but not in ``seqused``."""
    used = attention_mask.bool()
    kept = used if unused_mask is None else used | unused_mask.bool()
    seqused = used.sum(dim=-1, dtype=torch.int32)
    lengths = kept.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = torch.cumsum(lengths, dim=0)
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(lengths.max().item()) if lengths.numel() else 0, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of unpad_input: hidden_states [total, ...] scattered to positions ``indices`` of
    a zero [batch * seqlen, ...] tensor, returned as [batch, seqlen, ...]."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)  # out of place, so gradients flow to hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


# layers.rotary -------------------------------------------------------------------------------------------------

def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets=0, cu_seqlens: torch.Tensor | None = None,
                     max_seqlen: int | None = None) -> torch.Tensor:
    """Rotary embedding of the first ``2 * cos.shape[-1]`` channels of x [batch, seqlen, heads,
    head_dim] (or [total, heads, head_dim] with ``cu_seqlens``); the other channels are kept.
    cos and sin are [seqlen_ro, rotary_dim / 2]; the token at position i of sequence b uses row
    ``i + seqlen_offsets[b]`` (an int offset applies to every sequence). Non-interleaved pairs
    channel j with channel j + rotary_dim / 2 (GPT-NeoX); interleaved pairs 2j with 2j + 1 (GPT-J).
    Each pair (a, b) becomes (a cos - b sin, a sin + b cos), computed in float32 and rounded to
    x's dtype."""
    if cu_seqlens is not None:  # varlen: rotate each sequence as a batch of one
        parts = []
        for b in range(cu_seqlens.numel() - 1):
            start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
            offset = seqlen_offsets if isinstance(seqlen_offsets, int) else seqlen_offsets[b:b + 1]
            parts.append(apply_rotary_emb(x[start:end].unsqueeze(0), cos, sin, interleaved, False, offset)[0])
        out = torch.cat(parts) if parts else x.clone()
        return x.copy_(out) if inplace else out
    batch, seqlen = x.shape[0], x.shape[1]
    half = cos.shape[-1]
    rotary_dim = 2 * half
    positions = torch.arange(seqlen, device=x.device).unsqueeze(0).expand(batch, seqlen)
    if isinstance(seqlen_offsets, torch.Tensor):
        positions = positions + seqlen_offsets.to(x.device).long().reshape(-1, 1)
    else:
        positions = positions + int(seqlen_offsets)
    c = cos.float()[positions].unsqueeze(2)  # [batch, seqlen, 1, half]
    s = sin.float()[positions].unsqueeze(2)
    rot = x[..., :rotary_dim].float()
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        rotated = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    out = torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)
    return x.copy_(out) if inplace else out
