"""Packed variable-length batches: torch's `varlen_attn` and flash-attn's `flash_attn_varlen_func`,
with their signatures and semantics, run through decode.py.

Sequences are packed along the first dimension, [total, heads, head_dim], sequence b at rows
cu_seqlens[b] .. cu_seqlens[b + 1] - 1. Causal masks and windows align each sequence's queries to
the end of its keys, as both libraries do. route.py chooses the kernels: batches with few query
rows per K/V head (decode) run the split-KV kernels, longer ones the row-block kernels compiled for
packed batches (layout varlen), paged pools always the split-KV kernels. A call autograd records
runs the custom op rdnattention::flash_attn_decode_fwd, whose backward is the bwd family's passes
over the sequences (ops.flash_attn_varlen_bwd)."""

from __future__ import annotations

import torch

from . import decode, ops, padding, replay
from .checks import check_dtype, check_int32, check_memory, check_paged, check_same_dtype, reads
from .errors import InvalidArgumentError, UnsupportedError
from .options import (as_window, check_scale, check_score_options, check_window, refuse_missing_features,
                      replayable_types, replayed_score)


def _check_packed(name: str, t: object, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dtype(name, t)
    layout = "[total, heads, head_dim]" if dims == 3 else "[pages, page_size, heads, head_dim]"
    if t.dim() != dims:
        raise InvalidArgumentError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if any(s % 8 for s in t.stride()[:-1]):
        raise InvalidArgumentError(f"{name} rows must start on 16-byte boundaries: strides {t.stride()} must be "
                                   "multiples of 8 elements")
    return t


def _check_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{name} must be a non-negative int, got {value!r}")
    return value


# How the entry points name the arguments the index checks (decode.check_values) speak of.
_NAMES = {"cu_seqlens_q": "cu_seq_q", "cu_seqlens_k": "cu_seq_k", "seq_q": "max_q", "seq_k": "max_k"}


def _key(entry: str, q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, block_table, options: tuple, softcap=0.0,
         alibi_slopes=None, sinks=None) -> tuple | None:
    """The replay key of a call (replay.key): ints as ints, windows as tuples of two ints, the
    softcap with its type, the slopes and sinks as tensors, else none."""
    if (type(q) is not torch.Tensor or type(max_q) is not int or type(max_k) is not int
            or type(options[0]) is not tuple or len(options[0]) != 2 or type(options[0][0]) is not int
            or type(options[0][1]) is not int):
        return None
    return replay.key(entry, q.device, (q, k, v, cu_q, cu_k, seqused_k, block_table, alibi_slopes, sinks),
                      (max_q, max_k, *options, type(softcap), softcap))


# The express functions (replay.LastExpress) of varlen_attn and flash_attn_varlen_func: the
# geometry each served last by its replay, for calls of q, k, v and the two offsets alone (no key
# lengths, pages, ALiBi, sinks or LSE) whose offsets the value checks do not read (checks.reads: GPU
# tensors by default, RDNATTENTION_CHECK=0), made under the options _express_options gives.
_EXPRESS = {entry: replay.LastExpress(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"))
            for entry in ("varlen_attn", "flash_attn_varlen_func")}


def _express_options(q, max_q, max_k, window_size, scale, softcap, *flags) -> tuple | None:
    """The options of a packed call an express may serve, typed as _key types them (whole lengths,
    a window of two ints, a float or absent scale, the softcap with its type, the entry point's
    ``flags`` as given), or None (the entry point's own path decides): also None where the value
    checks read q's tensors' values."""
    if (type(q) is not torch.Tensor or type(max_q) is not int or type(max_k) is not int
            or not replayable_types(window_size, scale, softcap) or reads(q)):
        return None
    return max_q, max_k, window_size, scale, type(softcap), softcap, *flags


def _remember(entry: str, options: tuple | None, r: replay.Replay, key: tuple, q: torch.Tensor) -> None:
    """After a replay of ``key`` served a call an express may serve (``options``), makes that express
    (its output allocated as decode.allocate allocates it: like q where contiguous, else a stand-in)."""
    if options is None:
        return
    if not r.like:
        replay.keep_stand_ins(r, q.device, None if q.is_contiguous() else (tuple(q.shape), q.dtype))
    _EXPRESS[entry].remember(options, key, q.device)


def _replayed(r: replay.Replay | None, q, k, v, cu_q, cu_k, max_q: int, max_k: int, seqused_k, block_table,
              return_lse: bool, names: dict[str, str], softcap=0.0, alibi_slopes=None,
              sinks=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A call whose key was planned before (``r``, the replay kept for it), replayed
    (decode.replayed), or None (``r`` None: the key was not planned)."""
    if r is None:
        return None
    score = replayed_score(softcap, alibi_slopes, sinks)
    cu_k = None if block_table is not None else cu_k

    def check() -> None:  # the index values, where they are read: as decode.prepare checks them
        seq_k = block_table.shape[1] * k.shape[1] if block_table is not None else max_k
        decode.check_values(q, k, extents=decode.Extents(batch=cu_q.shape[0] - 1, seq_q=max_q, seq_k=seq_k),
                            seqused_k=seqused_k, block_table=block_table, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            names={**_NAMES, **names, **({"seq_k": "block_table's pages per sequence * page_size"}
                                                         if block_table is not None else {})})
    return decode.replayed(r, q, k, v, seqused_k=seqused_k, block_table=block_table, cu_seqlens_q=cu_q,
                           cu_seqlens_k=cu_k, return_lse=return_lse, check=check, score=score)


def _attention(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, scale, window_size, gqa: bool, seqused_k,
               block_table, num_splits: int, return_lse: bool, names: dict[str, str] | None = None,
               key: tuple | None = None, softcap=0.0, alibi_slopes=None,
               sinks=None, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    names = names or {}

    def n(name: str) -> str:  # the entry point's name of an argument
        return names.get(name, name)

    q = _check_packed(n("query"), q, 3)
    paged = block_table is not None
    k = _check_packed(n("key"), k, 4 if paged else 3)
    v = _check_packed(n("value"), v, 4 if paged else 3)
    if v.shape != k.shape:
        raise InvalidArgumentError(f"{n('value')} shape {tuple(v.shape)} must equal {n('key')} shape {tuple(k.shape)}")
    check_same_dtype((n("query"), q), (n("key"), k), (n("value"), v))
    max_q, max_k = _check_int(n("max_q"), max_q), _check_int(n("max_k"), max_k)
    device = q.device
    for name, t in ((n("key"), k), (n("value"), v)):
        if t.device != device:
            raise InvalidArgumentError(f"{name} is on {t.device}, {n('query')} on {device}")
    heads_q, head_dim = q.shape[1], q.shape[2]
    heads_kv = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise InvalidArgumentError(f"{n('key')} head_dim {k.shape[-1]} differs from {n('query')}'s {head_dim}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise InvalidArgumentError(f"{n('query')} heads ({heads_q}) must be a multiple of {n('key')}/{n('value')} "
                                   f"heads ({heads_kv})")
    if heads_q != heads_kv and not gqa:
        raise InvalidArgumentError(f"query has {heads_q} heads and key {heads_kv}: pass enable_gqa=True for "
                                   "grouped-query attention")
    cu_q = check_int32(n("cu_seq_q"), cu_q, 1, device)
    batch = cu_q.shape[0] - 1
    if batch < 0:
        raise InvalidArgumentError(f"{n('cu_seq_q')} must hold batch + 1 offsets, got none")
    if seqused_k is not None:
        seqused_k = check_int32(n("seqused_k"), seqused_k, (batch,), device)
    if paged:
        if seqused_k is None:
            raise InvalidArgumentError("block_table needs seqused_k: the keys each sequence holds in its pages")
        if cu_k is not None:
            raise InvalidArgumentError(f"{n('cu_seq_k')} must be None with a block table (keys are found through it)")
        block_table = check_paged(k, v, block_table, batch, n("key"), n("value"))
        seq_k = block_table.shape[1] * k.shape[1]
        names = {**names, "seq_k": "block_table's pages per sequence * page_size"}
    else:
        if cu_k is None:
            raise InvalidArgumentError(f"{n('cu_seq_k')} is required without a block table")
        cu_k = check_int32(n("cu_seq_k"), cu_k, (batch + 1,), device)
        seq_k = max_k
    left, right = check_window(window_size)
    left, right = (-1 if left >= max(seq_k, 1) else left), (max_q if right >= max_q else right)
    scale = check_scale(scale, head_dim, n("scale"))
    score = check_score_options(softcap, alibi_slopes, sinks, batch=batch, heads_q=heads_q, device=device,
                                sinks_grad=True)
    qkv_grad = q.requires_grad or k.requires_grad or v.requires_grad
    if torch.is_grad_enabled() and (qkv_grad or (score.sinks is not None and score.sinks.requires_grad)):
        # Autograd records the call: the custom op, whose backward is the packed backward kernels'
        # (and, for learned sinks, ops._sink_gradient).
        if paged:
            who = f"{n('query')}, {n('key')} or {n('value')}" if qkv_grad else "sinks"
            raise UnsupportedError(f"{who} requires grad, and the backward pass of packed sequences does not "
                                   f"take {n('block_table')}: run the call under torch.no_grad() or "
                                   "torch.inference_mode(), or pass detached tensors")
        ops.check_backward_built(q)
        out, lse = decode.flash_attn_decode_fwd(q, k, v, seqused_k, None, None, cu_q, cu_k, batch, max_q, seq_k, left,
                                                right, scale, True, num_splits, score.softcap, score.alibi_slopes,
                                                score.sinks, deterministic)
        return out, lse
    # The index values (offsets, pages, key counts) are checked where the call is planned
    # (decode.check_values), in eager mode and in the custom op alike.
    return decode.forward(q, k, v, window=(left, right), softmax_scale=scale, return_lse=return_lse,
                          extents=decode.Extents(batch=batch, seq_q=max_q, seq_k=seq_k), seqused_k=seqused_k,
                          block_table=block_table, cu_seqlens_q=cu_q, cu_seqlens_k=None if paged else cu_k,
                          num_splits=num_splits, names={**_NAMES, **names}, key=key, score=score)


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
                softcap=0.0, alibi_slopes=None, sinks=None):
    """torch.nn.attention.varlen.varlen_attn's signature and semantics: query
    [total_q, heads_q, head_dim], key and value [total_k, heads_kv, head_dim] (or a page pool
    [pages, page_size, heads_kv, head_dim] with ``block_table`` int32 [batch, pages per sequence],
    which needs ``seqused_k``), cu_seq_q / cu_seq_k int32 [batch + 1]. ``window_size=(-1, 0)`` is
    causal. Returns the output [total_q, heads_q, head_dim], and with ``return_aux.lse`` the
    log-sum-exp, float32 [heads_q, total_q] (the layout torch's kernels return). ``num_splits``:
    key slices (None: chosen from the device; 1: none, so results never depend on the batch).
    Beyond torch's signature, the score transforms of :func:`rdnattention.flash_attn` (keywords
    ``softcap``, ``alibi_slopes`` fp32 [heads_q] or [batch, heads_q], ``sinks`` fp32 [heads_q])."""
    if not isinstance(enable_gqa, bool):
        raise InvalidArgumentError(f"enable_gqa must be a bool, got {enable_gqa!r}")
    want_lse = bool(getattr(return_aux, "lse", False)) if return_aux is not None else False
    window_size = as_window(window_size)
    options = None
    if (not want_lse and seqused_k is None and block_table is None and alibi_slopes is None and sinks is None
            and (num_splits is None or type(num_splits) is int)):
        options = _express_options(query, max_q, max_k, window_size, scale, softcap, enable_gqa, num_splits)
        if options is not None:  # its guard holds every shape, stride, dtype and device
            out = _EXPRESS["varlen_attn"].run(options, query, key, value, cu_seq_q, cu_seq_k)
            if out is not None:
                return out
    plan_key = _key("varlen_attn", query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table,
                    (window_size, type(scale), scale, enable_gqa, type(num_splits), num_splits, want_lse), softcap,
                    alibi_slopes, sinks)
    r = replay.lookup(plan_key)
    hit = _replayed(r, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, seqused_k, block_table, want_lse, {},
                    softcap, alibi_slopes, sinks)
    if hit is not None:
        _remember("varlen_attn", options, r, plan_key, query)  # the next calls of this key take it
        out, lse = hit
        return (out, lse) if want_lse else out
    splits = 0 if num_splits is None else _check_int("num_splits", num_splits)
    out, lse = _attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                          gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table, num_splits=splits,
                          return_lse=want_lse, key=plan_key, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    return (out, lse) if want_lse else out


# flash-attn's names of the arguments _attention and decode.check_values speak of.
_FLASH_NAMES = {"query": "q", "key": "k", "value": "v", "cu_seq_q": "cu_seqlens_q", "cu_seq_k": "cu_seqlens_k",
                "cu_seqlens_q": "cu_seqlens_q", "cu_seqlens_k": "cu_seqlens_k", "max_q": "max_seqlen_q",
                "max_k": "max_seqlen_k", "seq_q": "max_seqlen_q", "seq_k": "max_seqlen_k", "scale": "softmax_scale",
                "seqused_k": "the key lengths in cu_seqlens_k"}


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, sinks=None):
    """flash-attn's ``flash_attn_varlen_func``: q [total_q, heads, head_dim], k and v
    [total_k, heads_kv, head_dim] (fewer heads: GQA), or a page pool with ``block_table``.
    Returns out [total_q, heads, head_dim], or ``(out, softmax_lse, None)`` with
    ``return_attn_probs=True`` (lse float32 [heads, total_q]). As flash-attn's entry does, a
    head_dim that is not a multiple of 8 (up to 256) is padded with zeros and the output sliced
    back, and tensors whose rows are not contiguous and 16-byte aligned are copied (padding.py).
    ``window_size``: a pair of ints, or of a CPU tensor (options.as_window). ``softcap`` and
    ``alibi_slopes`` (fp32 [heads] or [batch, heads]) as flash-attn's; ``sinks`` (keyword, fp32
    [heads]): attention sinks (docs/api.md). dropout raises UnsupportedError. Inputs that require
    grad get gradients (the packed backward passes, decode.py's autograd); ``deterministic=True``
    sums each of them in one order there."""
    return _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table,
                         entry="flash_attn_varlen_func", names=_FLASH_NAMES, sinks=sinks)


def _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                  window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table, *, entry: str,
                  names: dict[str, str], sinks=None):
    """flash_attn_varlen_func and its packed forms (``entry``), their errors in the entry point's
    ``names`` of the arguments."""
    refuse_missing_features(dropout_p)
    window_size = as_window(window_size)
    options = None
    if (entry in _EXPRESS and not return_attn_probs and block_table is None and alibi_slopes is None
            and sinks is None and type(causal) is bool and type(deterministic) is bool):
        options = _express_options(q, max_seqlen_q, max_seqlen_k, window_size, softmax_scale, softcap, causal,
                                   deterministic)
        if options is not None:  # its guard holds every shape, stride, dtype and device
            out = _EXPRESS[entry].run(options, q, k, v, cu_seqlens_q, cu_seqlens_k)
            if out is not None:
                return out
    plan_key = _key(entry, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None,
                    block_table, (window_size, type(softmax_scale), softmax_scale, type(causal), causal,
                                  type(deterministic), deterministic, type(return_attn_probs), return_attn_probs),
                    softcap, alibi_slopes, sinks)
    r = replay.lookup(plan_key)
    if r is not None:
        lengths = None
        if block_table is not None:
            check_memory(names["cu_seqlens_k"], cu_seqlens_k)
            lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        hit = _replayed(r, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, lengths,
                        block_table, return_attn_probs, names, softcap, alibi_slopes, sinks)
        if hit is not None:
            if entry in _EXPRESS:
                _remember(entry, options, r, plan_key, q)  # the next calls of this key take it
            out, lse = hit
            return (out, lse, None) if return_attn_probs else out
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise InvalidArgumentError(f"{name} must be a bool, got {flag!r}")
    if padding.needed(q, k, v, ranks=(3, 4)):  # as flash-attn's entry: head_dim padded to 8s, rows made readable
        return padding.run(lambda q, k, v, **kw: _flash_varlen(q, k, v, entry=entry, names=names, **kw),
                           dict(q=q, k=k, v=v), dict(
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic,
            return_attn_probs=return_attn_probs, block_table=block_table, sinks=sinks), scale_name="softmax_scale")
    left, right = check_window(window_size)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    seqused_k = None
    names = dict(names)
    if block_table is not None:  # flash-attn's paged varlen: key lengths from cu_seqlens_k
        if not isinstance(q, torch.Tensor):
            raise InvalidArgumentError(f"{names['query']} must be a torch.Tensor, got {type(q).__name__}")
        cu = check_int32(names["cu_seqlens_k"], cu_seqlens_k, 1, q.device)
        if not (torch.compiler.is_compiling() or torch.jit.is_tracing()):
            check_memory(names["cu_seqlens_k"], cu)
        seqused_k = (cu[1:] - cu[:-1]).to(torch.int32)
        cu_seqlens_k = None
    else:
        del names["seqused_k"]
    out, lse = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                          window_size=(left, right), gqa=True, seqused_k=seqused_k, block_table=block_table,
                          num_splits=0, return_lse=return_attn_probs, names=names, key=plan_key, softcap=softcap,
                          alibi_slopes=alibi_slopes, sinks=sinks, deterministic=deterministic)
    return (out, lse, None) if return_attn_probs else out


def _unpacked(name: str, packed: object, parts: int, layout: str) -> tuple[torch.Tensor, ...]:
    """The ``parts`` tensors packed along the second dimension of ``packed`` [total, parts,
    heads, head_dim], as views (nothing copied)."""
    if not isinstance(packed, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != 4 or packed.shape[1] != parts:
        raise InvalidArgumentError(f"{name} must be 4-D {layout}, got shape {tuple(packed.shape)}")
    return packed.unbind(1)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: qkv [total, 3, heads,
    head_dim] packs q, k and v of one set of sequences, cu_seqlens int32 [batch + 1] their offsets
    and max_seqlen the longest; otherwise as :func:`flash_attn_varlen_func` on ``qkv[:, 0]``,
    ``qkv[:, 1]`` and ``qkv[:, 2]``, which are views (copied only where flash_attn_varlen_func
    copies: a head_dim that is not a multiple of 8)."""
    q, k, v = _unpacked("qkv", qkv, 3, "[total, 3, heads, head_dim]")
    names = {**_FLASH_NAMES, "query": "qkv", "key": "qkv", "value": "qkv", "cu_seq_q": "cu_seqlens",
             "cu_seq_k": "cu_seqlens", "cu_seqlens_q": "cu_seqlens", "cu_seqlens_k": "cu_seqlens",
             "max_q": "max_seqlen", "max_k": "max_seqlen", "seq_q": "max_seqlen", "seq_k": "max_seqlen"}
    return _flash_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                         window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None,
                         entry="flash_attn_varlen_qkvpacked_func", names=names)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: kv [total_k, 2, heads_kv,
    head_dim] packs k and v; otherwise as :func:`flash_attn_varlen_func` on ``kv[:, 0]`` and
    ``kv[:, 1]``, which are views (copied only where flash_attn_varlen_func copies)."""
    k, v = _unpacked("kv", kv, 2, "[total_k, 2, heads_kv, head_dim]")
    names = {**_FLASH_NAMES, "key": "kv", "value": "kv"}
    return _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                         causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, None,
                         entry="flash_attn_varlen_kvpacked_func", names=names)
