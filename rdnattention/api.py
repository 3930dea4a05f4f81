"""The public entry points. Every argument is checked before anything is launched.

Three layouts of one forward pass: `flash_attn` on [batch, heads, seq, head_dim] (the native
layout), `flash_attn_func` on flash-attn's token-major [batch, seq, heads, head_dim], and
`scaled_dot_product_attention` with torch's signature and semantics. All three run the
`rdnattention::flash_attn_fwd` custom op (ops.py): called directly in eager mode, through the
dispatcher under torch.compile or on tensor subclasses, so compiled graphs need no break."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from . import ops, padding, replay
from .checks import NATIVE, TOKEN_MAJOR, check_fp16
from .errors import InvalidArgumentError, UnsupportedError
from .options import as_window, refuse_missing_features, replayable_types, validate
from .plan import Plan

_warned_layout = False


def rotary_tables(positions: int, rotary_dim: int, base: float = 10000.0,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables (cos, sin), float32 [positions, rotary_dim / 2], angle = position * base^(-2i/rotary_dim)."""
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        raise InvalidArgumentError(f"positions must be a positive int, got {positions!r}")
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or rotary_dim < 2 or rotary_dim % 2:
        raise InvalidArgumentError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if not isinstance(base, (int, float)) or not base > 1:
        raise InvalidArgumentError(f"base must be a number above 1, got {base!r}")
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(positions, dtype=torch.float64).unsqueeze(1) * inv_freq
    return angles.cos().float().to(device), angles.sin().float().to(device)


def _warn_if_token_major(q: torch.Tensor) -> None:
    global _warned_layout
    _, heads, seq, _ = q.shape
    if not _warned_layout and heads > 512 and seq < heads and not torch.compiler.is_compiling():
        _warned_layout = True
        warnings.warn(f"flash_attn takes {NATIVE}; q has shape {tuple(q.shape)}, {heads} heads for {seq} positions, "
                      f"which looks like {TOKEN_MAJOR}: use rdnattention.flash_attn_func for that layout",
                      stacklevel=3)


# The express functions (replay.LastExpress) of flash_attn and flash_attn_func: the geometry each
# served last by its replay, made under the options _express_options gives.
_flash_express = replay.LastExpress()
_func_express = replay.LastExpress()


def _express_options(is_causal, window_size, softmax_scale, softcap, rotary_interleaved) -> tuple | None:
    """The options of a flash_attn-like call that an express may serve, typed as ops.key types them
    (a window of two ints, a float or absent scale, the softcap with its type), or None (another
    call: the entry point's own path decides). The caller checks that the call has no tensor
    besides q, k and v and returns no LSE."""
    if (type(is_causal) is not bool or rotary_interleaved is not False
            or not replayable_types(window_size, softmax_scale, softcap)):
        return None
    return is_causal, window_size, softmax_scale, type(softcap), softcap


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
               window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
               rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
               rotary_interleaved: bool = False, return_lse: bool = False, seqused_k: torch.Tensor | None = None,
               softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
               deterministic: bool = False):
    """FlashAttention-2 forward on fp16 tensors [batch, heads, seq, head_dim]; returns a new tensor,
    or ``(out, lse)`` with ``return_lse=True`` (lse: float32 [batch, heads_q, seq_q], natural log).

    K and V may have fewer heads than Q (GQA/MQA: Q heads per K/V head must be a whole number) and a
    different sequence length (query i sits at key position i + Sk - Sq). ``is_causal`` hides keys after
    each query's position; ``window_size=(left, right)`` limits how far before/after it keys are seen
    (-1: unbounded). ``softmax_scale`` defaults to 1/sqrt(head_dim). ``rotary_cos``/``rotary_sin``
    ([positions, rotary_dim/2], float32 or q's dtype; see :func:`rotary_tables`) apply RoPE to Q and K
    in the kernel. ``seqused_k`` (int32 [batch]) gives the keys each batch uses, the first
    seqused_k[b] of a preallocated cache of seq_k rows; queries align to the end of those.

    Score transforms, each applied once to every visible score (docs/api.md): ``softcap`` (flash-attn's:
    a score s, the softmax scale applied, becomes softcap * tanh(s / softcap); 0.0: none),
    ``alibi_slopes`` (flash-attn's: fp32 [heads_q] or [batch, heads_q]; -slope * |i + Sk - Sq - j|
    is added to the scaled score of query i and key j) and ``sinks`` (fp32 [heads_q]: one logit per
    query head that joins each row's softmax denominator, and its LSE, and adds no value).

    ``deterministic`` (flash-attn's name) concerns the backward alone: True sums every gradient in
    one fixed order; by default dQ may be added by atomics (docs/api.md, Backward)."""
    if deterministic is not False and deterministic is not True:
        raise InvalidArgumentError(f"deterministic must be a bool, got {deterministic!r}")
    options = None
    if (return_lse is False and rotary_cos is None and rotary_sin is None and seqused_k is None
            and alibi_slopes is None and sinks is None):
        options = _express_options(is_causal, window_size, softmax_scale, softcap, rotary_interleaved)
        if options is not None:  # its guard holds every shape, stride, dtype and device
            out = _flash_express.run(options, q, k, v)
            if out is not None:
                return out
    key = ops.key(q, k, v, is_causal=is_causal, window_size=window_size, softmax_scale=softmax_scale,
                  return_lse=return_lse, token_major=False, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                  rotary_interleaved=rotary_interleaved, seqused_k=seqused_k, softcap=softcap,
                  alibi_slopes=alibi_slopes, sinks=sinks)
    hit = ops.replayed(key, q, k, v, return_lse=return_lse, token_major=False, rotary_cos=rotary_cos,
                       rotary_sin=rotary_sin, seqused_k=seqused_k, alibi_slopes=alibi_slopes, sinks=sinks)
    if hit is not None:
        if options is not None:
            _flash_express.remember(options, key, q.device)  # the next calls of this key take it
        return hit if return_lse else hit[0]
    q, k, v = (check_fp16(n, t, NATIVE) for n, t in (("q", q), ("k", k), ("v", v)))
    padding.refuse(q.shape[3])
    o = validate(q, k, v, is_causal=is_causal, window_size=window_size, softmax_scale=softmax_scale,
                 rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                 return_lse=return_lse, seqused_k=seqused_k, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if deterministic:
        o = dataclasses.replace(o, deterministic=True)
    _warn_if_token_major(q)
    out, lse = ops.forward(q, k, v, o, token_major=False, key=key)
    return (out, lse) if return_lse else out


def plan_flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                    rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                    rotary_interleaved: bool = False, return_lse: bool = False,
                    seqused_k: torch.Tensor | None = None, softcap: float = 0.0,
                    alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                    heavy_first: bool | None = None, kernel: str | None = None) -> Plan:
    """Validates a :func:`flash_attn` call and plans it without running it: the returned
    :class:`~rdnattention.plan.Plan` holds the outputs and launches; ``plan.run()`` executes it
    (again and again, for timing). ``heavy_first`` overrides the row-block order (default: longest
    first under causal-like masks); ``kernel`` forces a dispatch entry by name."""
    q, k, v = (check_fp16(n, t, NATIVE) for n, t in (("q", q), ("k", k), ("v", v)))
    padding.refuse(q.shape[3])
    if ops.grad_needed(q, k, v):  # a plan's run records nothing for autograd
        raise UnsupportedError("q, k or v requires grad, and a plan runs the forward only: call flash_attn, or plan "
                               "under torch.no_grad() or with detached tensors")
    o = validate(q, k, v, is_causal=is_causal, window_size=window_size, softmax_scale=softmax_scale,
                 rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                 return_lse=return_lse, seqused_k=seqused_k, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if heavy_first is not None and not isinstance(heavy_first, bool):
        raise InvalidArgumentError(f"heavy_first must be a bool or None, got {heavy_first!r}")
    if kernel is not None and not isinstance(kernel, str):
        raise InvalidArgumentError(f"kernel must be a kernel name (str) or None, got {kernel!r}")
    return ops.plan(q, k, v, o, token_major=False, heavy_first=heavy_first, kernel=kernel)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                    deterministic: bool = False, return_attn_probs: bool = False, *,
                    rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                    rotary_interleaved: bool = False, sinks: torch.Tensor | None = None):
    """flash-attn's ``flash_attn_func``: fp16 q [batch, seq_q, heads, head_dim], k and v
    [batch, seq_k, heads_kv, head_dim]; returns out [batch, seq_q, heads, head_dim], or
    ``(out, softmax_lse, None)`` with ``return_attn_probs=True`` (lse float32 [batch, heads, seq_q];
    the attention probabilities themselves are not materialised). Causal masks align to the end of
    the keys, as flash-attn's do. As flash-attn's entry does, a head_dim that is not a multiple of 8
    (up to 256) is padded with zeros and the output sliced back, and tensors whose last dimension
    is not contiguous or whose rows are not 16-byte aligned are copied (padding.py). ``softcap``
    and ``alibi_slopes`` as flash-attn's, ``sinks`` (keyword) and the RoPE options as in
    :func:`flash_attn`. dropout raises UnsupportedError. ``deterministic`` is flash-attn's: True makes
    the backward sum every gradient in one fixed order (as torch.use_deterministic_algorithms does);
    by default its dQ may be added by atomics, whose order varies (docs/api.md, Backward). The
    forward is deterministic either way. ``window_size``: a pair of ints, or of a CPU tensor
    (options.as_window)."""
    refuse_missing_features(dropout_p)
    window_size = as_window(window_size)
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise InvalidArgumentError(f"{name} must be a bool, got {flag!r}")
    options = None
    if (not return_attn_probs and rotary_cos is None and rotary_sin is None and alibi_slopes is None
            and sinks is None and (type(dropout_p) is float or type(dropout_p) is int) and not dropout_p):
        options = _express_options(causal, window_size, softmax_scale, softcap, rotary_interleaved)
        if options is not None:  # its guard holds every shape, stride, dtype and device
            out = _func_express.run(options, q, k, v)
            if out is not None:
                return out
    key = ops.key(q, k, v, is_causal=causal, window_size=window_size, softmax_scale=softmax_scale,
                  return_lse=return_attn_probs, token_major=True, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                  rotary_interleaved=rotary_interleaved, softcap=softcap, alibi_slopes=alibi_slopes,
                  sinks=sinks)  # of the token-major tensors as given
    hit = ops.replayed(key, q, k, v, return_lse=return_attn_probs, token_major=True, rotary_cos=rotary_cos,
                       rotary_sin=rotary_sin, alibi_slopes=alibi_slopes, sinks=sinks)
    if hit is None and padding.needed(q, k, v):  # as flash-attn's entry: head_dim padded to 8s, rows made readable
        return padding.run(flash_attn_func, dict(q=q, k=k, v=v), dict(
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, return_attn_probs=return_attn_probs,
            rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, deterministic=deterministic), scale_name="softmax_scale")
    if hit is not None:
        out, lse = hit
        if options is not None:
            _func_express.remember(options, key, q.device)  # the next calls of this key take it
    else:
        q, k, v = (check_fp16(n, t, TOKEN_MAJOR).transpose(1, 2) for n, t in (("q", q), ("k", k), ("v", v)))
        o = validate(q, k, v, is_causal=causal, window_size=window_size, softmax_scale=softmax_scale,
                     rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                     return_lse=return_attn_probs, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        if deterministic:
            o = dataclasses.replace(o, deterministic=True)
        out, lse = ops.forward(q, k, v, o, token_major=True, key=key)
        out = out.transpose(1, 2)
    return (out, lse, None) if return_attn_probs else out


def _unpacked(name: str, packed: object, parts: int, layout: str) -> tuple[torch.Tensor, ...]:
    """The ``parts`` tensors packed along the third dimension of ``packed`` [batch, seq, parts,
    heads, head_dim], as views (nothing copied), its dtype checked under the caller's name."""
    if not isinstance(packed, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != 5 or packed.shape[2] != parts:
        raise InvalidArgumentError(f"{name} must be 5-D {layout}, got shape {tuple(packed.shape)}")
    views = packed.unbind(2)
    check_fp16(name, views[0], layout)
    return views


def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes=None, deterministic: bool = False, return_attn_probs: bool = False):
    """flash-attn's ``flash_attn_qkvpacked_func``: qkv [batch, seq, 3, heads, head_dim] packs q, k
    and v; otherwise as :func:`flash_attn_func` on ``qkv[:, :, 0]``, ``qkv[:, :, 1]`` and
    ``qkv[:, :, 2]``, which are views (copied only where flash_attn_func copies: a head_dim that
    is not a multiple of 8)."""
    q, k, v = _unpacked("qkv", qkv, 3, "[batch, seq, 3, heads, head_dim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                             softmax_scale: float | None = None, causal: bool = False,
                             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                             deterministic: bool = False, return_attn_probs: bool = False):
    """flash-attn's ``flash_attn_kvpacked_func``: q [batch, seq_q, heads, head_dim], kv [batch,
    seq_k, 2, heads_kv, head_dim] packs k and v (fewer heads: GQA); otherwise as
    :func:`flash_attn_func` on ``kv[:, :, 0]`` and ``kv[:, :, 1]``, which are views."""
    k, v = _unpacked("kv", kv, 2, "[batch, seq_k, 2, heads_kv, head_dim]")
    q = check_fp16("q", q, TOKEN_MAJOR)
    if q.shape[0] != kv.shape[0] or q.shape[3] != kv.shape[4]:
        raise InvalidArgumentError(f"kv shape {tuple(kv.shape)} does not match q shape {tuple(q.shape)} in batch or "
                                   "head_dim")
    if kv.shape[3] == 0 or q.shape[2] % kv.shape[3]:
        raise InvalidArgumentError(f"q heads ({q.shape[2]}) must be a multiple of kv heads ({kv.shape[3]})")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


# scaled_dot_product_attention's express function of the geometry last replayed by its guard, made
# under the call's options (is_causal, scale, enable_gqa).
_sdpa_express = replay.LastExpress()


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention's signature and semantics on fp16
    [batch, heads, seq, head_dim]. As torch defines it, ``is_causal`` is top-left aligned: query i
    sees keys 0..i whatever the lengths. ``enable_gqa`` allows fewer K/V heads. An ``attn_mask`` or
    dropout raises UnsupportedError (use is_causal, or flash_attn's window_size)."""
    if attn_mask is not None:
        raise UnsupportedError("attn_mask: arbitrary masks are not supported; use is_causal, or "
                               "rdnattention.flash_attn with window_size for sliding windows")
    if dropout_p != 0.0:
        raise UnsupportedError(f"dropout_p={dropout_p!r}: the kernels have no attention dropout; pass 0.0")
    if not isinstance(enable_gqa, bool) or not isinstance(is_causal, bool):
        raise InvalidArgumentError(f"is_causal and enable_gqa must be bools, got {is_causal!r} and {enable_gqa!r}")
    options = (is_causal, scale, enable_gqa)
    if scale is None or type(scale) is float:
        # The express's guard holds every shape, stride, dtype and device the checks below read
        # (so the window and the key are those of the call it was made for): first.
        out = _sdpa_express.run(options, query, key, value)
        if out is not None:
            return out
    q, k, v = (check_fp16(n, t, NATIVE) for n, t in (("query", query), ("key", key), ("value", value)))
    padding.refuse(q.shape[3])
    if not enable_gqa and q.shape[1] != k.shape[1]:
        raise InvalidArgumentError(f"query has {q.shape[1]} heads and key {k.shape[1]}: pass enable_gqa=True for "
                                   "grouped-query attention")
    seq_q, seq_k = q.shape[2], k.shape[2]
    window = (-1, -1)
    whole = not (is_causal and seq_k > seq_q)
    if not whole:
        # Top-left: no query sees a key at or past seq_q, and on the first seq_q keys the
        # kernel's end-aligned diagonal is the top-left one.
        k, v = k[:, :, :seq_q], v[:, :, :seq_q]
        window = (-1, 0)
    elif is_causal:
        window = (-1, seq_q - seq_k)  # query i, end-aligned at i - (seq_q - seq_k), sees keys up to i
    key = ops.key(q, k, v, is_causal=False, window_size=window, softmax_scale=scale, return_lse=False,
                  token_major=False)
    hit = ops.replayed(key, q, k, v, return_lse=False, token_major=False)
    if hit is not None:
        if whole:  # (whole K and V: no slice of them made per call)
            _sdpa_express.remember(options, key, q.device)  # the next calls of this key take it
        return hit[0]
    o = validate(q, k, v, is_causal=False, window_size=window, softmax_scale=scale, rotary_cos=None,
                 rotary_sin=None, rotary_interleaved=False, return_lse=False)
    return ops.forward(q, k, v, o, token_major=False, key=key)[0]
