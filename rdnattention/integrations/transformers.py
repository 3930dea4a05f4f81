"""Hugging Face transformers: ``register()`` adds ``attn_implementation="rdnattention"``.

    import rdnattention.integrations.transformers as rt
    rt.register()
    model = AutoModelForCausalLM.from_pretrained(..., torch_dtype=torch.bfloat16, attn_implementation="rdnattention")

The attention function receives transformers' boolean mask (its sdpa mask function is registered
under the same name) and reads it as what padded batches and caches make of it: per sequence, a
run of valid query rows and a run of valid keys (left padding, right padding, the unused rows of a
StaticCache), causal within them with the queries at the end of the keys, or full. A mask that
broadcasts to [batch, heads, seq_q, seq_k] (batch 1, one head, fewer dimensions) is broadcast
first, as sdpa does; one that does not raises InvalidArgumentError, as sdpa raises. Such calls run
rdnattention's kernels (the split-KV kernels with per-sequence offsets and lengths); a call without
a mask runs ``flash_attn_func``'s forward on query, key and value as they are, with torch's
semantics (its output is the layout transformers wants, nothing copied), and an eager one of a
geometry served before replays its plan ahead of the checks (_replayed). Both go through the custom op
``rdnattention::padded_attention_fwd`` where torch compiles or traces, so compiled models call it
whole; eager calls run its implementation directly. Anything else falls back
to transformers' sdpa attention, with one warning per reason and every call counted in
``fallbacks``: a dtype other than float16 and bfloat16 (or mixed dtypes), a head_dim with no built
kernel, dropout while training, attention outputs or position biases, tensors or masks the kernels do not
take, any other mask (biases, sliding windows, document masks), and calls captured into a CUDA
graph (reading the mask needs the device: transformers' compiled StaticCache generation captures
its decode steps; eager generation with a StaticCache runs the kernels). Reading the mask costs
one device synchronisation per call. Rows of padding queries are zero (eager attention averages
every key there; docs/api.md says where that reaches a training loss). A logit softcap (Gemma 2's
``softcap``) and attention sinks (gpt-oss's ``s_aux``, one logit per query head) run in the kernels
(rdnattention's ``softcap`` and ``sinks``); where such a call falls back, it runs the attention
written out in torch (softmax of the capped scores, the sinks in the denominator), which sdpa
cannot express.

Inputs that require grad (training, LoRA fine-tuning) run rdnattention's backward through
autograd where it serves them (:func:`_trainable`: whole sequences and padded batches, causal or
full, sliding windows, softcaps and sinks (learned sinks get their gradient), a head_dim and dtype
with backward kernels). A padded batch's valid rows are packed into sequences for
flash_attn_varlen_func, whose backward takes per-sequence lengths (:func:`_packed_trainable`)."""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from .. import api, checks, ops, options, padding, replay, route, varlen
from ..errors import InvalidArgumentError, KernelsNotBuiltError, UnsupportedError
from ..tally import Tally

NAME = "rdnattention"
# The calls the kernels ran (hits), and by reason those that ran transformers' sdpa attention instead
# (each reason warns once; the counts go on).
_tally = Tally()


def counts(*, reset: bool = False) -> dict:
    """What the attention function did: ``{"served": calls run by the kernels, "fallback": calls
    run by transformers' sdpa attention, "fallbacks": {reason: calls}}`` (a copy; also
    ``rdnattention.stats()["transformers"]``). With ``reset=True`` the counts start again from
    zero, and each reason warns again."""
    served, fallbacks = _tally.read(reset=reset)
    return {"served": served, "fallback": sum(fallbacks.values()), "fallbacks": fallbacks}


def register(name: str = NAME) -> str:
    """Registers the attention function and its mask function under ``name`` (returned)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _fallback(reason: str, module, query, key, value, attention_mask, **kwargs):
    _fell_back(reason)
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap or sinks is not None:  # sdpa has neither: the attention written out
        scale = query.shape[-1] ** -0.5 if kwargs.get("scaling") is None else float(kwargs["scaling"])
        causal = bool(kwargs["is_causal"] if kwargs.get("is_causal") is not None else getattr(module, "is_causal", True))
        mask = attention_mask if attention_mask is not None else query.new_empty(0, dtype=torch.bool)
        return _math(query, key, value, mask, causal, scale, float(softcap or 0.0), sinks), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _autocast(query, key, value):
    """The tensors as autocast gives them to sdpa, which transformers' sdpa attention calls (an fp32
    query after RoPE under fp16 autocast, say): the SDPA patch's rule (sdpa._autocast); where it
    does not cast them, as they are."""
    if not torch.is_autocast_enabled(query.device.type):  # the common case, without the import below
        return query, key, value
    from .sdpa import _autocast as sdpa_autocast

    q, k, v, _, why = sdpa_autocast(query, key, value, None)
    return (query, key, value) if why else (q, k, v)


def _unsupported(module, query, key, value, dropout: float, kwargs: dict) -> str | None:
    if query.dtype not in checks.FLOAT_DTYPES or not query.dtype == key.dtype == value.dtype:
        return (f"dtype {query.dtype}: the kernels take float16 or bfloat16" if query.dtype == key.dtype == value.dtype
                else f"dtypes {query.dtype}, {key.dtype}, {value.dtype}: the kernels take one dtype")
    if dropout and module.training:
        return f"dropout {dropout} while training: the kernels have no attention dropout"
    if kwargs.get("position_bias") is not None:
        return "position_bias is not supported"
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is not None:
        try:
            options.check_softcap(softcap)
        except InvalidArgumentError as e:
            return str(e)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (query.shape[1],)
                              or sinks.device != query.device or not sinks.is_floating_point()):
        return "s_aux that is not one floating-point logit per query head on the query's device"
    if kwargs.get("output_attentions"):
        return "output_attentions: the attention weights are never materialised"
    return None


def _check_mask(mask: object, query: torch.Tensor, key: torch.Tensor) -> str | None:
    """Why the kernels cannot read ``mask`` (shapes, dtype and device only), or None. A mask that
    does not broadcast to [batch, heads_q, seq_q, seq_k], which sdpa refuses, raises
    InvalidArgumentError (more query rows or key columns than the tensors, another batch)."""
    if not isinstance(mask, torch.Tensor):
        return f"an attention mask of type {type(mask).__name__}"
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return f"an attention mask of dtype {mask.dtype}"
    target = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if mask.dim() > 4 or any(m not in (1, t) for m, t in zip(reversed(mask.shape), reversed(target))):
        raise InvalidArgumentError(f"attention_mask of shape {tuple(mask.shape)} does not broadcast to [batch, heads, "
                                   f"seq_q, seq_k] = {list(target)}")
    if mask.device != query.device:
        return f"an attention mask on {mask.device} for tensors on {query.device}"
    return None


def _broadcast(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """A mask _check_mask accepts as a [batch, 1 or heads, seq_q, seq_k] view (nothing copied)."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    return mask.expand(query.shape[0], mask.shape[1], query.shape[2], key.shape[2])


def _tensors_unsupported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the kernels cannot take these tensors (which sdpa would read or refuse), or None."""
    if not (query.dim() == key.dim() == value.dim() == 4):
        return "query, key and value that are not [batch, heads, seq, head_dim]"
    if (key.shape != value.shape or key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3]
            or key.shape[1] == 0 or query.shape[1] % key.shape[1]):
        return (f"key {tuple(key.shape)} and value {tuple(value.shape)} that do not match query "
                f"{tuple(query.shape)} in batch, head_dim or a whole number of query heads per K/V head")
    if not (query.device == key.device == value.device):
        return "query, key and value on different devices"
    return None


def _runs(mask: torch.Tensor, causal: bool, left: int = -1):
    """Per sequence (first query row, query rows, first valid key, valid keys) as int32 tensors, when
    ``mask`` [batch, 1 or heads, seq_q, seq_k] is the causal (or full) mask of one run of queries
    against one run of keys, the queries at the end of the keys, each causal query seeing at most
    ``left`` keys before its own (-1: all; a sliding window); else None. Rows outside the run are
    padding: they see no key (left padding) or every valid key, or with a sliding window its last
    valid keys (right padding, where the run ends at the first row that sees the last valid key);
    the kernels leave them zero."""
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == torch.finfo(mask.dtype).min) | torch.isneginf(mask)).all()):
            return None  # a bias, not a mask
        mask = mask == 0
    if mask.shape[1] != 1 and not bool((mask == mask[:, :1]).all()):
        return None
    m = mask[:, 0]
    _, seq_q, seq_k = m.shape
    cols = m.any(-2)
    k0, n = cols.int().argmax(-1), cols.sum(-1)
    counts = m.sum(-1)
    q0 = (counts > 0).int().argmax(-1)
    if causal:  # the run ends at the first row that sees the last valid key
        last = (k0 + n - 1).clamp(min=0).long()
        sees_last = m.gather(2, last[:, None, None].expand(-1, seq_q, 1))[..., 0]
        sq = torch.where(n > 0, sees_last.int().argmax(-1) - q0 + 1, 0)
    else:
        sq = (counts > 0).sum(-1)
    p = torch.arange(seq_q, device=m.device)[None, :, None] - q0[:, None, None]
    key = torch.arange(seq_k, device=m.device)[None, None, :] - k0[:, None, None]
    in_run = (p >= 0) & (p < sq[:, None, None])
    valid_key = (key >= 0) & (key < n[:, None, None])
    allowed = valid_key  # the run's mask, as it goes on past the run's rows
    if causal:
        allowed = allowed & (key <= p + (n - sq)[:, None, None])
        if left >= 0:
            allowed = allowed & (key >= p + (n - sq)[:, None, None] - left)
    expected = in_run & allowed
    # Outside the run: no key, all the valid keys, or, after the run (right padding), what the run's
    # mask gives a row there (a sliding window's last valid keys).
    after = (p >= sq[:, None, None])[..., 0] & (m == allowed).all(-1)
    padding_row_ok = (counts == 0) | (counts == n[:, None]) | after
    ok = torch.where(in_run, expected == m[:, :, :], (padding_row_ok[:, :, None] & (~m | valid_key)))
    if not bool(ok.all()):
        return None
    return q0.int(), sq.int(), k0.int(), n.int()


def _offsets(t: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """int32 [batch + 1]: row b * (batch stride / row stride) + first[b] of t [batch, heads, rows, dim]
    (the decode kernels' start offsets); the last entry bounds the final batch."""
    per = t.stride(0) // t.stride(2)
    starts = torch.arange(t.shape[0], device=t.device, dtype=torch.int64) * per + first.long()
    end = starts[-1:] + t.shape[2] if t.shape[0] else starts.new_zeros(1)
    return torch.cat([starts, end]).to(torch.int32)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention interface: query [batch, heads, seq_q, head_dim], key and value
    [batch, heads_kv, seq_k, head_dim]; returns ([batch, seq_q, heads, head_dim], None)."""
    if attention_mask is None:
        out = _replayed(module, query, key, value, dropout, scaling, is_causal, kwargs)
        if out is not None:
            _tally.hit()
            return out, None
    query, key, value = _autocast(query, key, value)
    reason = _unsupported(module, query, key, value, dropout, kwargs)
    if reason:
        return _fallback(reason, module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
    reason = _tensors_unsupported(query, key, value)
    if reason is None and attention_mask is not None:
        reason = _check_mask(attention_mask, query, key)
    if reason:
        return _fallback(reason, module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    sliding_window = kwargs.get("sliding_window")
    left = -1
    if sliding_window is not None:  # transformers' sliding window of W keys: a query sees W - 1 keys before its own
        if (not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1
                or not causal):
            return _fallback(f"sliding_window {sliding_window!r} (the kernels take a causal window of a positive "
                             "int)", module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)
        left = sliding_window - 1
    s_aux = kwargs.get("s_aux")
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                    or (s_aux is not None and s_aux.requires_grad)):
        reason, out = _trainable(query, key, value, attention_mask, causal, scale, left, kwargs)
        if reason:
            return _fallback(reason, module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             is_causal=is_causal, **kwargs)
        _tally.hit()
        return out, None
    softcap, sinks = float(kwargs.get("softcap") or 0.0), kwargs.get("s_aux")
    if sinks is not None:  # a parameter in the model's dtype: the kernels read fp32 logits
        sinks = sinks.detach().to(torch.float32)
    if (not (torch.compiler.is_compiling() or torch.jit.is_tracing())
            and type(query) is type(key) is type(value) is torch.Tensor
            and (attention_mask is None or type(attention_mask) is torch.Tensor)):
        # Eager: the op's implementation called directly, without the dispatcher's cost (as ops.forward),
        # no empty mask made for a call without one, and the tensors and mask checked above once
        return _padded_attention(query, key, value, attention_mask, causal, scale, left, softcap, sinks,
                                 checked=True), None
    if attention_mask is None:
        attention_mask = query.new_empty(0, dtype=torch.bool)  # none: torch's SDPA semantics
    return padded_attention_fwd(query, key, value, attention_mask, causal, scale, left, softcap, sinks), None


def _trainable(query, key, value, mask, causal: bool, scale: float, left: int, kwargs: dict):
    """A call whose inputs require grad (training, fine-tuning): ``(None, out)`` where rdnattention's
    backward serves it, through autograd (:func:`rdnattention.flash_attn`), else ``(reason, None)``.
    Served: whole sequences (no mask, or a mask that is causal or full over every position: batches
    of equal length, as training packs them), causal with queries at the end of the keys or full, a
    sliding window, a softcap, attention sinks (``s_aux``, learned or not: they get their gradient);
    with a head_dim and dtype the device has backward kernels for. Padded batches (a mask of one run
    of valid queries and keys per sequence, as _runs reads it; reading it costs a synchronisation,
    as in inference) run packed (_packed_trainable)."""
    try:
        table = route.device_table(query.device)
    except (KernelsNotBuiltError, UnsupportedError) as e:
        return f"no kernels for {query.device.type}: {e}", None
    missing = ops.backward_missing(table, query)
    if missing:
        return f"inputs that require grad, and {missing}", None
    seq_q, seq_k = query.shape[2], key.shape[2]
    if mask is not None:
        if not checks.can_read(mask):
            return "inputs that require grad, and reading the attention mask needs the device", None
        checks.check_memory("attention_mask", mask)
        runs = _runs(_broadcast(mask, query, key), causal, left)
        if runs is None:
            return ("inputs that require grad, and an attention mask that is not causal or full over one run of "
                    "valid positions per sequence"), None
    elif causal and seq_q != seq_k and seq_q > 1:  # sdpa's is_causal without a mask is top-left
        return "inputs that require grad, is_causal and no mask with fewer queries than keys", None
    try:  # (a forward kernel the device lacks, such as a score option's at this head_dim: refused before any launch)
        if mask is not None:
            out = _packed_trainable(query, key, value, runs, causal, scale, left, kwargs)
            if out is not None:
                return None, out
        sinks = kwargs.get("s_aux")
        out = api.flash_attn(query, key, value, is_causal=causal and seq_q > 1,
                             window_size=(left, 0 if causal else -1), softmax_scale=scale,
                             softcap=float(kwargs.get("softcap") or 0.0),
                             sinks=None if sinks is None else sinks.to(torch.float32))  # the cast keeps its gradient
    except (UnsupportedError, KernelsNotBuiltError) as e:
        return str(e), None
    return None, out.transpose(1, 2)


def _packed_rows(first: torch.Tensor, count: torch.Tensor, per: int, total: int):
    """The rows of each sequence's run in [batch * per] flat rows (sequence b's ``count[b]`` rows from
    ``b * per + first[b]``), one after another as int64 indices, and the int32 offsets [batch + 1] of
    the runs in that packed order; ``total``: the sum of ``count`` (so nothing is read back)."""
    cu = torch.zeros(count.shape[0] + 1, dtype=torch.int32, device=count.device)
    cu[1:] = count.cumsum(0)
    base = torch.arange(count.shape[0], device=count.device) * per + first - cu[:-1]
    rows = torch.repeat_interleave(base, count, output_size=total) + torch.arange(total, device=count.device)
    return rows, cu


def _packed_trainable(query, key, value, runs, causal: bool, scale: float, left: int, kwargs: dict):
    """A padded batch that requires grad, as [batch, seq_q, heads, head_dim]: the run of valid query
    rows and the run of valid keys of each sequence (``runs``, _runs') gathered into packed
    sequences, as transformers' flash-attention path unpads them, run through
    flash_attn_varlen_func (its autograd: the packed backward passes) and scattered back, padding
    rows zero as in the forward. The gathers and the scatter are torch's differentiable indexing,
    so the gradients reach the padded tensors. None where every sequence is whole (no copy needed:
    the caller runs the batch as it is). One read of the run lengths (the packed sizes)."""
    q0, sq, k0, n = runs
    batch, heads, seq_q, head_dim = query.shape
    seq_k = key.shape[2]
    zero = sq.new_zeros(1)
    whole = ((sq == seq_q) & (n == seq_k) & (q0 == 0) & (k0 == 0)).all().int()
    whole, max_q, max_k, total_q, total_k = torch.stack(
        [whole, torch.cat([sq, zero]).max(), torch.cat([n, zero]).max(), sq.sum(), n.sum()]).tolist()
    if whole:
        return None
    rows_q, cu_q = _packed_rows(q0.long(), sq, seq_q, total_q)
    rows_k, cu_k = _packed_rows(k0.long(), n, seq_k, total_k)

    def packed(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # [batch, h, s, d] -> [total, h, d]
        return t.transpose(1, 2).reshape(-1, t.shape[1], head_dim).index_select(0, rows)

    sinks = kwargs.get("s_aux")
    out = varlen.flash_attn_varlen_func(
        packed(query, rows_q), packed(key, rows_k), packed(value, rows_k), cu_q, cu_k, max_q, max_k,
        softmax_scale=scale, causal=causal, window_size=(left, 0 if causal else -1),
        softcap=float(kwargs.get("softcap") or 0.0), sinks=None if sinks is None else sinks.to(torch.float32))
    full = out.new_zeros(batch * seq_q, heads, head_dim).index_copy(0, rows_q, out)
    return full.view(batch, seq_q, heads, head_dim)


def _math(query, key, value, mask, causal: bool, scale: float, softcap: float, sinks) -> torch.Tensor:
    """The attention of a model with a softcap or sinks written out in torch, as transformers' eager
    attention computes it (fp32 softmax), as [batch, seq_q, heads, head_dim]; ``mask`` empty: none
    (sdpa's semantics: causal top-left)."""
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    s = (query @ k.transpose(2, 3)).float() * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask.numel():
        s = s + (torch.where(mask, 0.0, -math.inf) if mask.dtype == torch.bool else mask.float())
    elif causal and query.shape[2] > 1:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.float().reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    # A row that sees no key (and has no sink) gives zero, and zero gradients: its scores are made
    # finite before the softmax, whose backward would otherwise be NaN, and its weights dropped.
    seen = (s > -math.inf).any(dim=-1, keepdim=True)
    p = (torch.softmax(torch.where(seen, s, 0.0), dim=-1) * seen)[..., :key.shape[2]]
    return (p.to(v.dtype) @ v).transpose(1, 2).contiguous()


def _sdpa(query, key, value, mask, causal: bool, scale: float, left: int = -1, softcap: float = 0.0,
          sinks=None) -> torch.Tensor:
    """What transformers' sdpa attention computes, as [batch, seq_q, heads, head_dim] (``left`` >= 0:
    a causal sliding window, made a mask where none is given; with a softcap or sinks, which sdpa
    has not: _math)."""
    gqa = key.shape[1] != query.shape[1]
    if mask.numel() == 0 and left >= 0:
        seq_q, seq_k = query.shape[2], key.shape[2]
        diagonal = torch.arange(seq_q, device=query.device)[:, None] + (seq_k - seq_q)
        keys = torch.arange(seq_k, device=query.device)[None, :]
        mask = (keys <= diagonal) & (keys >= diagonal - left)
    if softcap or sinks is not None:
        return _math(query, key, value, mask, causal, scale, softcap, sinks)
    if mask.numel() == 0:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=causal and query.shape[2] > 1, scale=scale, enable_gqa=gqa)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                               enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def _fell_back(reason: str) -> None:
    """Counts a call that runs sdpa for ``reason``; the first of each reason warns."""
    if _tally.add(reason):
        warnings.warn(f"rdnattention: {reason}; these calls run transformers' sdpa attention instead",
                      RuntimeWarning, stacklevel=4)


_NO_MASK = torch.empty(0, dtype=torch.bool)  # no mask (sdpa's semantics), where only its emptiness is read


@torch.library.custom_op("rdnattention::padded_attention_fwd", mutates_args=())
def padded_attention_fwd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         causal: bool, scale: float, left: int = -1, softcap: float = 0.0,
                         sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention of a padded batch as [batch, seq_q, heads, head_dim]; ``mask`` empty: none;
    ``left`` >= 0: a causal sliding window of left + 1 keys; ``softcap`` (0.0: none) and ``sinks``
    (fp32 [heads_q] or None) as rdnattention's. A custom op, so that compiled models (transformers
    compiles StaticCache generation) call it whole: reading the mask needs the device, which a CUDA
    graph being captured cannot give; such calls run torch's SDPA with the mask (_math with a
    softcap or sinks), with a warning. Eager calls run its implementation, _padded_attention."""
    return _padded_attention(query, key, value, mask, causal, scale, left, softcap, sinks)


def _padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      causal: bool, scale: float, left: int = -1, softcap: float = 0.0,
                      sinks: Optional[torch.Tensor] = None, checked: bool = False) -> torch.Tensor:
    """padded_attention_fwd's implementation; ``mask`` None or empty: none; ``checked``: the
    tensors and the mask have passed _tensors_unsupported and _check_mask (attention_forward)."""
    transforms = (left, softcap, sinks)
    unmasked = mask is None or not mask.numel()
    if mask is None:
        mask = _NO_MASK
    reason = None
    if not checked:
        reason = _tensors_unsupported(query, key, value)
        if reason is None and not unmasked:
            reason = _check_mask(mask, query, key)
    if reason:  # attention_forward sends these calls to sdpa; a direct call of the op runs torch's SDPA
        _fell_back(reason)
        return _sdpa(query, key, value, mask, causal, scale, *transforms)
    try:
        if unmasked and left < 0:
            out = _unmasked(query, key, value, causal and query.shape[2] > 1, scale, softcap, sinks)
            _tally.hit()
            return out
        if unmasked:  # a sliding window over whole sequences: no mask to read
            batch, seq_q, seq_k = query.shape[0], query.shape[2], key.shape[2]
            runs = tuple(torch.full((batch,), x, dtype=torch.int32, device=query.device) for x in (0, seq_q, 0, seq_k))
            out = _padded(query, key, value, runs, causal, scale, left, softcap, sinks)
            _tally.hit()
            return out
        if not checks.can_read(mask):
            _fell_back("a CUDA graph is being captured, and reading the attention mask needs the device")
            return _sdpa(query, key, value, mask, causal, scale, *transforms)
        checks.check_memory("attention_mask", mask)
        runs = _runs(_broadcast(mask, query, key), causal, left)
        if runs is None:
            _fell_back("an attention mask that is not causal or full over one run of valid positions per sequence")
            return _sdpa(query, key, value, mask, causal, scale, *transforms)
        out = _padded(query, key, value, runs, causal, scale, left, softcap, sinks)
        _tally.hit()
        return out
    except (UnsupportedError, KernelsNotBuiltError) as e:
        _fell_back(str(e))
        return _sdpa(query, key, value, mask, causal, scale, *transforms)


@padded_attention_fwd.register_fake
def _(query, key, value, mask, causal, scale, left=-1, softcap=0.0, sinks=None):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


def _replayed(module, query, key, value, dropout, scaling, is_causal, kwargs: dict) -> torch.Tensor | None:
    """An eager call without a mask whose geometry was served before, replayed before any of
    attention_forward's checks (None where it was not, or where a check would read more than the
    replay key holds). The key (_unmasked's) holds the tensors' shapes, strides, dtypes and devices
    and the options, and only calls that passed every check are kept under it; what it does not
    hold is checked here: autocast, dropout while training, and the keyword arguments that make a
    call fall back or take another path (sinks, a sliding window, position biases, attention
    outputs). Gradients, tracing and tensor subclasses give no key."""
    if (kwargs.get("s_aux") is not None or kwargs.get("sliding_window") is not None
            or kwargs.get("position_bias") is not None or kwargs.get("output_attentions")
            or (dropout and module.training) or type(query) is not torch.Tensor
            or (replay.autocast_on() and torch.is_autocast_enabled(query.device.type))):
        return None
    softcap = kwargs.get("softcap")
    if softcap is not None and type(softcap) is not float and type(softcap) is not int:
        return None  # _unsupported checks it
    seq_q = query.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and seq_q > 1
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    softcap = float(softcap or 0.0)
    window = _window(causal, seq_q, key.shape[2])
    if window is not None:
        out = _express.run((window, scale, softcap), query, key, value)
        if out is not None:
            return out
    return _unmasked(query, key, value, causal, scale, softcap, None, replay_only=True)


def _window(causal: bool, seq_q: int, seq_k: int) -> tuple[int, int] | None:
    """The window _unmasked gives the kernels for sdpa's causal flag (top-left) on whole K and V, or
    None where it takes a slice of them instead (a causal call with more keys than queries): what an
    express planned for one cache length may serve at another (a growing cache) only where equal."""
    if not causal:
        return (-1, -1)
    return None if seq_k > seq_q else (-1, seq_q - seq_k)


# The express function of the geometry last replayed by its guard (or followed along a growing
# cache), made under the options it was planned for: (window, scale, softcap).
_express = replay.LastExpress()


def _unmasked(query, key, value, causal: bool, scale: float, softcap: float, sinks,
              replay_only: bool = False) -> torch.Tensor | None:
    """A call without a mask with sdpa's semantics (causal top-left, as api.scaled_dot_product_attention
    maps it onto flash-attn's windows), as [batch, seq_q, heads, head_dim]: flash_attn_func's
    forward on query, key and value as they are (the kernel's views), its output token-major, so
    nothing is copied after. Replayed under its own key (ops.key with ``views``), so a call
    transposes nothing; the first of a geometry is validated and planned as flash_attn_func's, and
    one whose rows need copies (padding.py) runs flash_attn_func itself. ``replay_only``: None
    instead of the first."""
    seq_q, seq_k = query.shape[2], key.shape[2]
    whole = _window(causal, seq_q, seq_k)
    if whole is None:  # causal with more keys than queries: no query sees a key at or past seq_q
        key, value, window = key[:, :, :seq_q], value[:, :, :seq_q], (-1, 0)
    else:
        window = whole
    plan_key = ops.key(query, key, value, is_causal=False, window_size=window, softmax_scale=scale, return_lse=False,
                       token_major=True, softcap=softcap, sinks=sinks, views=True)
    hit = ops.replayed(plan_key, query, key, value, return_lse=False, token_major=True, sinks=sinks, views=True)
    if hit is not None and sinks is None and whole is not None:
        _express.remember((window, scale, softcap), plan_key, query.device)  # the next calls of this key take it
    if hit is not None or replay_only:
        return None if hit is None else hit[0]
    if padding.needed(query, key, value):
        return api.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                   softmax_scale=scale, window_size=window, softcap=softcap, sinks=sinks)
    o = options.validate(query, key, value, is_causal=False, window_size=window, softmax_scale=scale, rotary_cos=None,
                         rotary_sin=None, rotary_interleaved=False, return_lse=False, softcap=softcap, sinks=sinks)
    out, _ = ops.forward(query, key, value, o, token_major=True, key=plan_key)
    return out.transpose(1, 2)


def _padded(query, key, value, runs, causal: bool, scale: float, left: int = -1, softcap: float = 0.0,
            sinks=None) -> torch.Tensor:
    q0, sq, k0, n = runs
    if query.stride(0) % query.stride(2) or query.stride(3) != 1:
        query = query.contiguous()
    if (key.stride(0) % key.stride(2) or key.stride(3) != 1 or value.stride() != key.stride()):
        key, value = key.contiguous(), value.contiguous()
    out = torch.zeros_like(query)  # same strides as query: one set of offsets serves both
    batch, _, seq_q, _ = query.shape
    call = route.Attention(q=query, k=key, v=value, out=out, lse=None, window=(left, 0) if causal else (-1, -1),
                           softmax_scale=scale, batch=batch, seq_q=seq_q, seq_k=key.shape[2], seqused_k=n,
                           cu_seqlens_q=_offsets(query, q0), cu_seqlens_k=_offsets(key, k0), seqused_q=sq,
                           softcap=softcap, sinks=sinks)
    for name, t in (("query", query), ("key", key), ("value", value), ("s_aux", sinks)):
        if t is not None:
            checks.check_memory(name, t)
    route.plan(route.device_table(query.device), call).run()
    return out.transpose(1, 2).contiguous()
