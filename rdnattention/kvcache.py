"""flash-attn's ``flash_attn_with_kvcache``: decode and chunked prefill against a preallocated KV
cache with per-sequence lengths, appending the new keys and values in place.

A call is checked whole before anything is written: the arguments' shapes, dtypes, devices,
strides and options where it is traced (validate), then the memory behind every tensor and, where
they are read (checks.reads), the index values (one read: checks.Values), then it is planned (the
kernel chosen, the launch grid checked); only then are the new keys and values appended and the kernels run. A refused call
leaves every tensor it was given as it was.

Plain caches with automatic key slices run as flash_attn calls with cache lengths (ops.py), the
others through decode.py; route.py chooses the kernels of both: the split-KV decode kernels for
paged caches, cache_batch_idx, explicit num_splits and calls with few query rows per K/V head, the
fp16 row-block kernels with cache lengths (f16 of layout len) otherwise. The append (the new keys
and values written, RoPE on them and on the queries in float64, rounded once to the dtype as
reference.rotate rounds, the lengths bounded and the lengths after it) is done by the attention's
own launch where that is one split-KV decode launch and the new keys are few (FUSE_MAX_NEW; the
decode kernels' fa2_decode_append, which rotates the queries it reads too), else by one launch of
the append family (families/append.py) before the attention's, or by torch operations where the
device's kernels have none (counted: counts()). Where torch traces or the tensors are subclasses,
a call that appends runs the custom op ``rdnattention::flash_attn_kvcache_fwd`` (it mutates the
caches; its implementation is the eager path, checks included), one that does not the custom ops
of ops.py and decode.py."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from . import checks, decode, drivers, ops, padding, replay, route, workspace
from .families import append as append_family, dec as dec_family
from .checks import TOKEN_MAJOR, check_fp16, check_int32, check_paged, check_same_dtype
from .errors import InvalidArgumentError, RdnaAttentionError, UnsupportedError
from .options import (NO_SCORE_OPTIONS, Options, ScoreOptions, as_window, check_score_options, check_seqused,
                      replayed_score, validate)
from .plan import Plan
from .reference import rotate
from .tally import Tally


def _check_tables(cos: object, sin: object, interleaved: object, q: torch.Tensor) -> None:
    if (cos is None) != (sin is None):
        raise InvalidArgumentError("rotary_cos and rotary_sin must be given together")
    if not isinstance(interleaved, bool):
        raise InvalidArgumentError(f"rotary_interleaved must be a bool, got {interleaved!r}")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype not in (torch.float32, torch.float16, q.dtype):
            raise InvalidArgumentError(f"{name} must be a float32, float16 or q's dtype ({q.dtype}) tensor "
                                       "[positions, rotary_dim/2]")
        if t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}")
    if cos.shape != sin.shape or 2 * cos.shape[1] > q.shape[3]:
        raise InvalidArgumentError(f"rotary_cos {tuple(cos.shape)} and rotary_sin {tuple(sin.shape)} must have one "
                                   f"shape, with rotary_dim = 2 * width at most head_dim {q.shape[3]}")


def _check_cache_view(name: str, t: torch.Tensor) -> None:
    """A cache or page pool [rows, positions, heads_kv, head_dim] as the kernels read it, by its own
    strides: contiguous in head_dim, positions and heads on 16-byte multiples."""
    checks.check_rows(name, t.transpose(1, 2))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            sinks=None):
    """flash-attn's signature, in its order, and semantics: q [batch, seq_q, heads, head_dim];
    k_cache, v_cache [batch_cache, cache_len, heads_kv, head_dim], or with ``block_table`` (int32
    [batch, pages per sequence]) a page pool [pages, page_size, heads_kv, head_dim] (page_size a
    power of two); ``cache_batch_idx`` (int32 [batch]) the cache row of each sequence (default: its
    own); cache_seqlens (int, or int32 [batch]) the valid length of each sequence's cache (None: the
    whole cache); ``cache_leftpad`` (int32 [batch], at most cache_seqlens) the position each
    sequence's keys start at (None: 0): keys before it take no part, and the masks align to the
    end of the keys as without it (not with block_table or cache_batch_idx). With k, v [batch,
    seq_new, heads_kv, head_dim], they are written into the cache in place at cache_seqlens (after
    RoPE at their positions when rotary_cos/rotary_sin are given; q is rotated at cache_seqlens + i
    under a causal or local mask, else at cache_seqlens), and attention covers keys cache_leftpad ..
    cache_seqlens + seq_new - 1. Queries align to the end of each sequence's keys. ``window_size``:
    a pair of ints, or of a CPU tensor (options.as_window). ``num_splits``: key slices of the
    split-KV kernels (0: chosen from the device). ``softcap`` and ``alibi_slopes`` (fp32 [batch,
    heads] or [heads]) as flash-attn's, ``sinks`` (keyword, fp32 [heads]) as in
    :func:`rdnattention.flash_attn`; ALiBi with cache_leftpad raises UnsupportedError. Returns
    out [batch, seq_q, heads, head_dim], with the LSE [batch, heads, seq_q] if return_softmax_lse.
    A call that raises has written nothing. As flash-attn's entry does, q, k and v whose rows are
    not contiguous and 16-byte aligned run on copies, and a head_dim that is not a multiple of 8
    (up to 256) on padded copies of every tensor, the cache copied back (padding.py); a cache whose
    rows are not contiguous and aligned is refused (InvalidArgumentError), never copied."""
    if (type(cache_seqlens) is torch.Tensor and cache_leftpad is None and alibi_slopes is None
            and sinks is None and return_softmax_lse is False and type(causal) is bool
            and type(rotary_interleaved) is bool and type(num_splits) is int and type(window_size) is tuple
            and len(window_size) == 2 and type(window_size[0]) is int and type(window_size[1]) is int
            and not checks.reads(cache_seqlens)):
        out = _express.run((type(softmax_scale), softmax_scale, causal, window_size, rotary_interleaved, num_splits,
                            type(softcap), softcap),
                           q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table)
        if out is not None:
            if k is not None:
                _tally.hit()
            return out
    if cache_leftpad is not None and alibi_slopes is not None:
        raise UnsupportedError("alibi_slopes with cache_leftpad: the left-padded cache runs as a packed batch, "
                               "whose ALiBi positions are not flash-attn's; pass one of them")
    window_size = as_window(window_size)
    plan_key = None if cache_leftpad is not None else _key(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table,
        (softmax_scale, causal, window_size, rotary_interleaved, num_splits, return_softmax_lse),
        softcap, alibi_slopes, sinks)
    r = replay.lookup(plan_key)
    if r is not None:
        score = replayed_score(softcap, alibi_slopes, sinks)
        hit = _replayed(r, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        block_table, rotary_interleaved, num_splits, return_softmax_lse, score)
        if hit is not None:
            if (type(cache_seqlens) is torch.Tensor and not return_softmax_lse and alibi_slopes is None
                    and sinks is None and replay.guarded(plan_key)):
                _make_express(r, plan_key, q, k)
            return hit if return_softmax_lse else hit[0]
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise InvalidArgumentError(f"num_splits must be a non-negative int, got {num_splits!r}")
    for name, flag in (("causal", causal), ("return_softmax_lse", return_softmax_lse)):
        if not isinstance(flag, bool):
            raise InvalidArgumentError(f"{name} must be a bool, got {flag!r}")
    if padding.needed(q, k_cache, v_cache, k, v, in_place=(k_cache, v_cache)):  # as flash-attn's (padding.py)
        return padding.run(flash_attn_with_kvcache, dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v), dict(
            rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=softmax_scale, causal=causal,
            window_size=window_size, rotary_interleaved=rotary_interleaved, num_splits=num_splits,
            return_softmax_lse=return_softmax_lse, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks),
            scale_name="softmax_scale", written=("k_cache", "v_cache") if k is not None else (),
            in_place=("k_cache", "v_cache"))
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_fp16(name, t, TOKEN_MAJOR)
    check_same_dtype(("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    given = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v), ("rotary_cos", rotary_cos),
             ("rotary_sin", rotary_sin), ("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
             ("cache_leftpad", cache_leftpad), ("block_table", block_table), ("alibi_slopes", alibi_slopes),
             ("sinks", sinks))
    given = [(name, t) for name, t in given if isinstance(t, torch.Tensor)]
    for name, t in given:
        if t.device != q.device and name in ("k", "v"):
            raise InvalidArgumentError(f"{name} is on {t.device}, the cache on {q.device}: the new keys and values "
                                       "are written into the cache")
        if t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}")
    traced = (torch.compiler.is_compiling() or torch.jit.is_tracing()
              or not all(type(t) is torch.Tensor for _, t in given))
    if not traced:  # before any view of them is made (a view beyond its storage is torch's RuntimeError)
        for name, t in given:
            checks.check_memory(name, t)
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):  # read in place, never copied to align
            checks.check_rows(name, t)
            if t.numel() and t.data_ptr() % 16:
                raise InvalidArgumentError(f"{name} rows must start on 16-byte boundaries: its data pointer is "
                                           f"{t.data_ptr() % 16} bytes past one")
    batch = q.shape[0]
    if v_cache.shape != k_cache.shape:
        raise InvalidArgumentError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape "
                                   f"{tuple(k_cache.shape)}")
    if block_table is not None and cache_batch_idx is not None:
        raise InvalidArgumentError("cache_batch_idx and block_table exclude each other: a paged cache is addressed "
                                   "through its block table")
    if cache_leftpad is not None:
        if block_table is not None or cache_batch_idx is not None:
            other = "block_table" if block_table is not None else "cache_batch_idx"
            raise UnsupportedError(f"cache_leftpad with {other}: a left-padded cache is read as each sequence's own "
                                   "rows, in order; pass the cache rows themselves")
        cache_leftpad = check_int32("cache_leftpad", cache_leftpad, (batch,), q.device)
    capacity = _capacity(block_table)
    if block_table is not None:
        block_table = check_paged(k_cache, v_cache, block_table, batch, "k_cache", "v_cache")
        cache_len = block_table.shape[1] * k_cache.shape[1]
    else:
        cache_len = k_cache.shape[1]
        if cache_batch_idx is not None:
            cache_batch_idx = check_int32("cache_batch_idx", cache_batch_idx, (batch,), q.device)
        elif k_cache.shape[0] != batch:
            raise InvalidArgumentError(f"q has batch {batch}, the cache {k_cache.shape[0]} (give cache_batch_idx to "
                                       "pick cache rows)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_cache_view(name, t)
    if (k is None) != (v is None):
        raise InvalidArgumentError("k and v must be given together")
    if rotary_cos is not None and k is None:
        raise InvalidArgumentError("rotary_cos/rotary_sin apply to the new k and q: give k and v with them")
    new = 0
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            check_fp16(name, t, TOKEN_MAJOR)
            if t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:] or t.shape != k.shape:
                raise InvalidArgumentError(f"{name} shape {tuple(t.shape)} must be [batch, seq_new, heads_kv, "
                                           f"head_dim] matching the cache {tuple(k_cache.shape)}")
        check_same_dtype(("k_cache", k_cache), ("k", k), ("v", v))
        new = k.shape[1]
        if new > cache_len:
            raise InvalidArgumentError(f"seq_new ({new}) must not exceed {capacity} ({cache_len}): the new keys are "
                                       "written into the cache")
    if rotary_cos is not None or rotary_sin is not None:
        _check_tables(rotary_cos, rotary_sin, rotary_interleaved, q)

    if cache_seqlens is None:
        lengths = torch.full((batch,), cache_len, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= cache_len - new:
            raise InvalidArgumentError(f"cache_seqlens + seq_new ({new}) must lie in [0, {capacity} = {cache_len}], "
                                       f"got cache_seqlens {cache_seqlens}")
        lengths = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        if not isinstance(cache_seqlens, torch.Tensor):
            raise InvalidArgumentError("cache_seqlens must be an int or an int32 [batch] tensor, got "
                                       f"{type(cache_seqlens).__name__}")
        lengths = check_seqused(cache_seqlens, q.transpose(1, 2), "cache_seqlens")

    qv = q.transpose(1, 2)
    if block_table is None and cache_batch_idx is None:
        kv, vv = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    else:  # stand-ins of the logical [batch, heads_kv, cache_len, head_dim] shape: validate reads only shapes
        # (the caches' own strides are checked above)
        kv = vv = k_cache.new_empty(k_cache.shape[-1]).as_strided(
            (batch, k_cache.shape[2], cache_len, k_cache.shape[3]), (0, 0, 0, 1))
    o = validate(qv, kv, vv, is_causal=causal, window_size=window_size, softmax_scale=softmax_scale,
                 rotary_cos=None, rotary_sin=None, rotary_interleaved=False, return_lse=return_softmax_lse,
                 seqused_k=lengths, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                        ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("sinks", sinks)):
            if t is not None and t.requires_grad:
                raise UnsupportedError(f"flash_attn_with_kvcache has no backward pass and {name} requires grad: run it "
                                       "under torch.no_grad() or torch.inference_mode(), or pass detached tensors")

    local = causal or tuple(window_size) != (-1, -1)
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, lengths, cache_batch_idx, block_table,
            o.window_left, o.window_right, o.softmax_scale, rotary_interleaved, local, return_softmax_lse, num_splits)
    if traced:
        out, lse = _traced(*args, cache_len=cache_len, leftpad=cache_leftpad, score=o.score)
    else:
        out, lse = _run(*args, key=plan_key, leftpad=cache_leftpad, score=o.score)
    return (out, lse) if return_softmax_lse else out


def _key(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, block_table,
         options: tuple, softcap=0.0, alibi_slopes=None, sinks=None) -> tuple | None:
    """The replay key of a call (replay.key): its options with their types, and how cache_seqlens
    is given (an int's value is checked per call), or None where the full path must run."""
    softmax_scale, causal, window_size, interleaved, num_splits, return_lse = options
    if (type(q) is not torch.Tensor or type(causal) is not bool or type(interleaved) is not bool
            or type(num_splits) is not int or type(return_lse) is not bool or type(window_size) is not tuple
            or len(window_size) != 2 or type(window_size[0]) is not int or type(window_size[1]) is not int):
        return None
    if cache_seqlens is None or type(cache_seqlens) is int:
        lengths, given = None, type(cache_seqlens)
    else:
        lengths, given = cache_seqlens, torch.Tensor
    return replay.key("flash_attn_with_kvcache", q.device,
                      (q, k_cache, v_cache, k, v, cos, sin, lengths, cache_batch_idx, block_table, alibi_slopes,
                       sinks),
                      (type(softmax_scale), softmax_scale, causal, window_size, interleaved, num_splits, return_lse,
                       given, type(softcap), softcap))


# The express function (replay.express) of the geometry last replayed by its guard, with the options
# it was planned for, as _key holds them: (type(softmax_scale), softmax_scale, causal, window_size,
# rotary_interleaved, num_splits, type(softcap), softcap); for calls with cache_seqlens an int32
# tensor, no cache_leftpad, ALiBi or sinks, no LSE, whose lengths the value checks do not read
# (checks.reads: where they do, _replayed reads them). Its roles are each replay's (_make_express).
_express = replay.LastExpress(())


def _make_express(r: replay.Replay, plan_key: tuple, q: torch.Tensor, k) -> None:
    """Makes the express of ``r`` (a replay of ``plan_key``, whose guard is the current one) the one
    the next calls try, where its launches take nothing but the call's tensors, the output, the
    split-KV scratch and the regions (an append through torch operations: none)."""
    kept: Kept = r.extra
    if k is not None and not kept.kernel:
        return
    if not r.like:  # its output allocated as _replayed allocates it
        replay.keep_stand_ins(r, q.device, None if kept.contiguous else (tuple(q.shape), q.dtype))
    roles = (*_REPLAYED[:7], kept.lengths, *_REPLAYED[8:10])
    _, options, *_ = plan_key
    scale_type, scale, causal, window, interleaved, splits, _, _, softcap_type, softcap = options
    _express.remember((scale_type, scale, causal, window, interleaved, splits, softcap_type, softcap), plan_key,
                      q.device, roles, (("q_src", 0),) if k is not None else (), kept.regions)


# The launch fields of _replayed's tensors but the lengths (whose field is Kept.lengths), in its order.
_REPLAYED = ("q", "k", "v", "k_new", "v_new", "rotary_cos", "rotary_sin", "", "cache_batch_idx", "block_table",
             "alibi_slopes", "sinks")


@dataclass(eq=False, slots=True)
class Kept:
    """What a planned call fixed for the later calls of its key (replay.Replay.extra): validation's
    options, the cache's length, how the append runs, and what follows from the key's shapes: the
    launch field that takes the lengths, the workspace regions of the append's intermediates
    (replay.launch's ``regions``), and whether q is contiguous (its output allocated as q is)."""

    window_left: int
    window_right: int
    softmax_scale: float
    local: bool
    cache_len: int
    kernel: bool  # an append kernel is built (else the append runs as torch operations: _run)
    fused: bool  # the append in the attention's launch
    lengths: str = "seqused_k"
    regions: tuple | None = None
    contiguous: bool = False

    @classmethod
    def of(cls, q: torch.Tensor, rope: bool, appends: bool, **options) -> Kept:
        """The record of a call planned on q; ``rope``: it has RoPE tables; ``appends``: it appends
        with the kernels (the fused decode's or the append family's)."""
        kept = cls(**options, contiguous=q.is_contiguous())
        if appends:
            # What the append writes for the attention alone, in the stream's workspace rather than
            # allocated per call: its own launch's lengths after it (int32 [batch]; fused, the
            # attention reads the lengths before it) and, with RoPE, the rotated queries (laid out as
            # the planned call's torch.empty_like(q): dense, q's bytes), which the attention reads as
            # q, the append reading q_src.
            nbytes, fields = 0, ()
            if not kept.fused:
                kept.lengths = "cache_seqlens"
                nbytes, fields = workspace.align(4 * q.shape[0]), (("seqused_k", 0),)
            if rope:
                fields += (("q", nbytes),)
                nbytes += q.numel() * q.element_size()
            kept.regions = (nbytes, fields) if fields else None
        return kept


def _replayed(r: replay.Replay, q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, cache_batch_idx, block_table,
              interleaved: bool, num_splits: int, return_lse: bool,
              score: ScoreOptions) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A call whose key was planned before (validated then: the key holds all validation read),
    run on that plan: its memory and index values checked as _run checks them, its outputs
    allocated, and the launches (the append kernel's among them) replayed; a call that appends with
    torch operations (no append kernel built) runs _run's general path. None where its memory
    needs the full path."""
    kept: Kept = r.extra
    if cache_seqlens is None or type(cache_seqlens) is int:
        new = 0 if k is None else k.shape[1]
        if cache_seqlens is not None and not 0 <= cache_seqlens <= kept.cache_len - new:
            return None  # the full path raises the error
        lengths = torch.full((q.shape[0],), kept.cache_len if cache_seqlens is None else cache_seqlens,
                             dtype=torch.int32, device=q.device)
    else:
        lengths = cache_seqlens
    if k is not None and not kept.kernel:  # the append as torch operations: _run's general path
        return _run(q, k_cache, v_cache, k, v, cos, sin, lengths, cache_batch_idx, block_table, kept.window_left,
                    kept.window_right, kept.softmax_scale, interleaved, kept.local, return_lse, num_splits,
                    replayed=r, score=score)
    # _run's steps that read more than the key holds (its shape checks passed when the key was planned)
    found = replay.pointers((q, k_cache, v_cache, k, v, cos, sin, lengths, cache_batch_idx, block_table,
                             *score.tensors), r.reach, 3)
    if found is None:
        return None
    if checks.reads(lengths):
        new = 0 if k is None else k.shape[1]
        paged = block_table is not None
        check_values(lengths, new, kept.cache_len, k_cache.shape[0], cache_batch_idx, block_table,
                     k_cache.shape[0] if paged else 0, cos.shape[0] if cos is not None else None,
                     max(new, q.shape[1] if kept.local else min(q.shape[1], 1)), None)
    if score.alibi_slopes is not None or score.sinks is not None:
        values = checks.Values()
        for name, t in (("alibi_slopes", score.alibi_slopes), ("sinks", score.sinks)):
            values.finite(name, t)
        values.check()
    # [batch, seq_q, heads, head_dim]; empty_like keeps a contiguous q's strides, and costs less so
    out = torch.empty_like(q) if kept.contiguous else torch.empty_like(q, memory_format=torch.contiguous_format)
    pointers = dict(zip(_REPLAYED, found))  # (absent ones are no field of the launches)
    pointers["o"] = out.data_ptr()
    pointers[kept.lengths] = found[7]
    lse = None
    if return_lse:  # [batch, heads, seq_q]
        like = r.like or replay.keep_stand_ins(r, q.device, ((q.shape[0], q.shape[2], q.shape[1]), torch.float32))
        lse = torch.empty_like(like[0], memory_format=replay.CONTIGUOUS)
        pointers["lse"] = lse.data_ptr()
    if k is not None:  # the append: in the attention's launch (fused: fa2_decode_append) or its own first
        _tally.hit()
        pointers["q_src"] = found[0]
    replay.launch(r, pointers, q.device, kept.regions)
    return out, lse


def _traced(q, k_cache, v_cache, k, v, cos, sin, lengths, cache_batch_idx, block_table, window_left: int,
            window_right: int, softmax_scale: float, interleaved: bool, local: bool, return_lse: bool,
            num_splits: int, *, cache_len: int, leftpad=None,
            score: ScoreOptions = NO_SCORE_OPTIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """A call where torch traces (or on subclasses), through the custom ops: the one that appends
    (and every call with cache_leftpad), or, without new keys, those of ops.py and decode.py (each
    checks the index values it is given)."""
    if k is not None or leftpad is not None:
        return flash_attn_kvcache_fwd(q, k_cache, v_cache, k, v, cos, sin, lengths, cache_batch_idx, block_table,
                                      window_left, window_right, softmax_scale, interleaved, local, return_lse,
                                      num_splits, leftpad, score.softcap, score.alibi_slopes, score.sinks)
    if block_table is None and cache_batch_idx is None and num_splits == 0:
        o = Options(window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
                    rotary_cos=None, rotary_sin=None, rotary_interleaved=False, return_lse=return_lse,
                    seqused_k=lengths, score=score)
        out, lse = ops.forward(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), o,
                               token_major=True)
        return out.transpose(1, 2), lse
    return decode.forward(q, k_cache, v_cache, window=(window_left, window_right), softmax_scale=softmax_scale,
                          return_lse=return_lse,
                          extents=decode.Extents(batch=q.shape[0], seq_q=q.shape[1], seq_k=cache_len),
                          seqused_k=lengths, block_table=block_table, cache_batch_idx=cache_batch_idx,
                          num_splits=num_splits, names={"seqused_k": "cache_seqlens", "seq_k": "cache_len"},
                          score=score)


def _capacity(block_table) -> str:
    """What bounds cache_seqlens + seq_new, as messages name it: the cache's length, or with a paged
    cache the pages its block table gives each sequence."""
    return "cache_len" if block_table is None else "block_table's pages per sequence * page_size"


def check_values(lengths: torch.Tensor, new: int, cache_len: int, cache_rows: int, cache_batch_idx, block_table,
                 pages: int, positions: int | None, rotated: int, leftpad: torch.Tensor | None = None) -> bool:
    """A call's index values, in one read where they are read (checks.Values): cache lengths with
    room for the new keys, left padding from 0 up to the cache lengths, cache rows and pages within
    the cache, and, with RoPE tables of ``positions`` rows, positions up to cache_seqlens +
    ``rotated`` - 1 within them. Returns whether they were read (else _run bounds them on the
    device)."""
    values = checks.Values()
    capacity = _capacity(block_table)
    values.within("cache_seqlens", lengths, 0, cache_len - new,
                  rule=f"cache_seqlens + seq_new ({new}) must lie in [0, {capacity} = {cache_len}]")
    values.within("cache_leftpad", leftpad, 0, cache_len)
    if leftpad is not None:
        values.at_most("cache_leftpad", leftpad, lengths, "cache_seqlens (keys start at cache_leftpad, before "
                                                            "the cache's end)")
    values.within("cache_batch_idx", cache_batch_idx, 0, cache_rows - 1)
    values.within("block_table", block_table, 0, pages - 1)
    if positions is not None:
        values.within("cache_seqlens", lengths, 0, positions - rotated,
                      rule=f"rotary tables have {positions} positions; the new keys and queries need "
                           f"cache_seqlens + {rotated} of them")
    return values.check()


_aranges: dict[tuple[int, torch.device], torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """0 .. n - 1, int64 on ``device``: made once per length and device and only ever read (one made
    while a graph is captured is that graph's, and not kept)."""
    t = _aranges.get((n, device))
    if t is None:
        t = torch.arange(n, device=device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()) and len(_aranges) < 256:
            _aranges[(n, device)] = t
    return t


# Calls whose append ran as torch operations because the device's kernels have no append kernel
# (kernels built before the family existed), by reason; each reason warns once (counts()).
# The hits are the calls whose append ran the kernel.
_tally = Tally()


def counts(*, reset: bool = False) -> dict:
    """What the appends did: ``{"append_kernel": calls that appended with the append kernel,
    "append_torch": calls that appended with torch operations, "fallbacks": {reason: calls}}`` (a
    copy; also ``rdnattention.stats()["kvcache"]``). With ``reset=True`` the counts start again
    from zero, and each reason warns again."""
    appended, fallbacks = _tally.read(reset=reset)
    return {"append_kernel": appended, "append_torch": sum(fallbacks.values()), "fallbacks": fallbacks}


def _append_kernel(q: torch.Tensor, cos, interleaved: bool) -> bool:
    """Whether the append kernel of the call's dtype and RoPE mode is built for q's device (else
    the call appends with torch operations)."""
    if q.shape[3] > append_family.HEAD_DIM_MAX:
        return False
    try:
        append_family.select(route.device_table(q.device), interleaved if cos is not None else None,
                             "bf16" if q.dtype == torch.bfloat16 else None)
    except RdnaAttentionError:  # no append kernel (or no kernels: planning raises that)
        return False
    return True


def _count(device: torch.device, kernel: bool) -> None:
    """Counts a call that appends, with the kernel or with torch operations; the first fallback of
    each reason warns."""
    if kernel:
        _tally.hit()
        return
    reason = f"no append kernel for {route.device_table(device).target}"
    if _tally.add(reason):
        warnings.warn(f"rdnattention: {reason} (its kernels were built without the append family); "
                      "flash_attn_with_kvcache appends with torch operations there (rebuild the kernels: "
                      "rdnattention-gen build)", RuntimeWarning, stacklevel=4)


def _torch_append(k_cache, v_cache, k_in, v, positions, cache_batch_idx, block_table, checked: bool) -> None:
    """The append as torch operations (where no append kernel is built): the new keys (rotated)
    and values written at ``positions`` (int64 [batch, seq_new], bounded)."""
    batch = positions.shape[0]
    if block_table is not None:  # page block_table[b, pos // page], row pos % page
        page = k_cache.shape[1]
        slots = block_table.gather(1, positions // page)
        if not checked:
            slots = slots.clamp_(0, k_cache.shape[0] - 1)
        rows = positions % page
        k_cache.index_put_((slots, rows), k_in)
        v_cache.index_put_((slots, rows), v)
    else:
        rows = (cache_batch_idx if cache_batch_idx is not None else _arange(batch, positions.device))[:, None]
        if not checked and cache_batch_idx is not None:
            rows = rows.clamp(0, k_cache.shape[0] - 1)
        k_cache.index_put_((rows, positions), k_in)
        v_cache.index_put_((rows, positions), v)


# The most new keys per sequence that the attention's launch appends itself, where it is one split-KV
# decode launch: each of its workgroups writes every new key of its K/V head (fa2_decode.h), so a
# longer append runs the append kernel's launch before the attention's instead.
FUSE_MAX_NEW = 16


def _fuse(plan: Plan | None, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, cos: torch.Tensor | None,
          sin: torch.Tensor | None, interleaved: bool, local: bool) -> bool:
    """Gives the append to ``plan``'s launch where it is one split-KV decode launch (whose arguments
    have the append's fields and, with RoPE tables, whose kernel rotates: dec.ROPE_MIN_HEAD_DIM),
    planned on the lengths before the append (with RoPE tables, on the rotated queries' buffer,
    which the launch writes from ``q``); False (the plan unchanged) otherwise."""
    if plan is None or len(plan.launches) != 1 or not hasattr(plan.launches[0].args, "append_rows"):
        return False
    if cos is not None and plan.launches[0].kernel.head_dim < dec_family.ROPE_MIN_HEAD_DIM:
        return False  # compiled without the rotation (families/dec.py)
    args = plan.launches[0].args
    args.append_rows, args.k_new, args.v_new = k.shape[1], k.data_ptr(), v.data_ptr()
    args.rope = 0 if cos is None else 1 if interleaved else 2
    for name, value in append_family.shared_fields(k, v, q, cos, sin, local).items():
        setattr(args, name, value)
    return True


# The tensors a call reads, by name, in the order _run checks their memory; the pointer fields of
# its launches, each filled by one tensor.
_NAMES = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
          "block_table", "alibi_slopes", "sinks")
ROLES = frozenset({"q", "k", "v", "o", "lse", "seqused_k", "cache_batch_idx", "block_table", "alibi_slopes", "sinks",
                   # the append's own (families/append.py; it shares the others with the attention)
                   "k_new", "v_new", "q_src", "cache_seqlens", "rotary_cos", "rotary_sin"})


def _run(q, k_cache, v_cache, k, v, cos, sin, lengths, cache_batch_idx, block_table, window_left: int,
         window_right: int, softmax_scale: float, interleaved: bool, local: bool, return_lse: bool,
         num_splits: int, key: tuple | None = None, replayed: replay.Replay | None = None,
         leftpad: torch.Tensor | None = None,
         score: ScoreOptions = NO_SCORE_OPTIONS) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A validated call (shapes, options: flash_attn_with_kvcache), in eager mode or as the custom
    op's implementation: memory and index values checked and the call planned, then the append,
    then the launches. With ``key``, the plan is kept for later calls of that key; ``replayed``:
    such a later call, run on that plan (None returned where its memory needs the full path).
    ``leftpad``: cache_leftpad (a plain cache; never replayed), run by _leftpad_plan."""
    batch, seq_q = q.shape[0], q.shape[1]
    paged = block_table is not None
    page = k_cache.shape[1]
    cache_len = block_table.shape[1] * page if paged else page
    new = 0 if k is None else k.shape[1]
    tensors = (q, k_cache, v_cache, k, v, cos, sin, lengths, cache_batch_idx, block_table, *score.tensors)
    if replayed is None:
        for name, t in zip(_NAMES, tensors):
            if t is not None:
                checks.check_memory(name, t)
        if leftpad is not None:
            checks.check_memory("cache_leftpad", leftpad)
    elif replay.pointers(tensors, replayed.reach, 3) is None:
        return None
    rotated = max(new, seq_q if local else min(seq_q, 1))
    if cos is not None and cos.shape[0] < rotated:
        raise InvalidArgumentError(f"rotary tables have {cos.shape[0]} positions; the new keys and queries need "
                                   f"cache_seqlens + {rotated} of them")
    checked = checks.reads(lengths) and check_values(lengths, new, cache_len, k_cache.shape[0], cache_batch_idx,
                                                     block_table, k_cache.shape[0] if paged else 0,
                                                     cos.shape[0] if cos is not None else None, rotated, leftpad)
    if replayed is not None:  # planned calls check them where planned (ops.plan, decode.prepare)
        values = checks.Values()
        for name, t in (("alibi_slopes", score.alibi_slopes), ("sinks", score.sinks)):
            values.finite(name, t)
        values.check()

    # What the kernels read, computed apart from the caches: the rotated queries and new keys, the
    # lengths after the append. Values that were not read are bounded on the device: the lengths
    # within [0, cache_len - seq_new], the tables' positions within them, and below the cache rows
    # and pages the append writes (the kernels bound what they read themselves). The append kernel
    # (families/append.py) does all of it in one launch, planned here and run before the attention's;
    # where none is built for the device, torch operations do (a counted fallback, _torch_append).
    q_in, k_in = q, k
    kernel = None
    if k is not None:
        kernel = _append_kernel(q, cos, interleaved) if replayed is None else replayed.extra.kernel
    # The append fused into the attention's launch (fa2_decode.h's fa2_decode_append), where that is
    # one split-KV decode launch: tried first for few new keys (every workgroup writes them), planned
    # on the lengths before the append (and, with RoPE tables, on the rotated queries' buffer); a
    # plan of another kind is planned again below.
    fuse = bool(kernel) and replayed is None and leftpad is None and batch > 0 and 0 < new <= FUSE_MAX_NEW
    if fuse:
        used = lengths
        if cos is not None:
            q_in = torch.empty_like(q)
    elif kernel:
        used = q.new_empty((batch,), dtype=torch.int32)  # written by the append
        if cos is not None:
            q_in = torch.empty_like(q)
        if leftpad is not None:  # read by the left-padded plan before the append runs: the same values
            if not checked:
                lengths = lengths.clamp(0, cache_len - new)
            used = lengths + new
    elif k is not None:
        if not checked:
            lengths = lengths.clamp(0, cache_len - new)
        positions = lengths[:, None] + _arange(new, q.device)  # int64 [batch, seq_new]
        if cos is not None:
            last = cos.shape[0] - 1
            k_pos = positions if checked else positions.clamp(max=last)
            k_in = rotate(k.transpose(1, 2), cos, sin, k_pos, interleaved).transpose(1, 2)
            q_pos = lengths[:, None] + (_arange(seq_q, q.device) if local else 0)
            q_pos = q_pos if checked else q_pos.clamp(max=last)
            q_in = rotate(q.transpose(1, 2), cos, sin, q_pos.expand(batch, seq_q), interleaved).transpose(1, 2)
        used = lengths + new  # int32
    else:
        used = lengths
    if leftpad is not None and not checked:  # within [0, cache_seqlens]
        leftpad = torch.minimum(leftpad.clamp(min=0), lengths.clamp(0, cache_len))
    # Planned before the append: a call no kernel serves, or whose grid is beyond the launch
    # limits, is refused with the caches untouched.
    plain = block_table is None and cache_batch_idx is None and num_splits == 0

    def planned(q_in: torch.Tensor, used: torch.Tensor):
        if leftpad is not None:
            return _leftpad_plan(q_in, k_cache, v_cache, used, leftpad, (window_left, window_right), softmax_scale,
                                 return_lse, num_splits, cache_len, score)
        if plain:
            o = Options(window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
                        rotary_cos=None, rotary_sin=None, rotary_interleaved=False, return_lse=return_lse,
                        seqused_k=used, score=score)
            plan = ops.plan(q_in.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), o,
                            token_major=True, values_checked=True)
            out, lse = plan.outputs
            return out.transpose(1, 2), lse, plan
        return decode.prepare(q_in, k_cache, v_cache, window=(window_left, window_right),
                              softmax_scale=softmax_scale, return_lse=return_lse,
                              extents=decode.Extents(batch=batch, seq_q=seq_q, seq_k=cache_len), seqused_k=used,
                              block_table=block_table, cache_batch_idx=cache_batch_idx, num_splits=num_splits,
                              values_checked=True, score=score)

    plan = None
    fused = False  # _fuse's, below (a replayed call reaches here only to append with torch operations: _replayed)
    if replayed is not None:  # planned by an earlier call of its key
        if plain:
            out, lse = ops.allocate(q_in.transpose(1, 2), True, return_lse, empty_lse=False)
            out = out.transpose(1, 2)
        else:
            out, lse = decode.allocate(q_in, return_lse, False, empty_lse=False)
    else:
        out, lse, plan = planned(q_in, used)
        if fuse:
            fused = _fuse(plan, k, v, q, cos, sin, interleaved, local)
            if not fused:  # the attention is not one split-KV launch: the append runs before it
                used = q.new_empty((batch,), dtype=torch.int32)
                out, lse, plan = planned(q_in, used)
    launch = None  # the append's own (a replay has it among its steps)
    if kernel and batch and replayed is None and not fused:
        launch = append_family.launch(route.device_table(q.device), k_new=k, v_new=v, k_cache=k_cache,
                                      v_cache=v_cache, q=q, q_out=q_in, cache_seqlens=lengths, used=used,
                                      cache_batch_idx=cache_batch_idx, block_table=block_table, cos=cos, sin=sin,
                                      interleaved=interleaved, local=local,
                                      dtype="bf16" if q.dtype == torch.bfloat16 else None)

    if k is not None:
        _count(q.device, bool(kernel))
    if k is not None and not kernel:
        _torch_append(k_cache, v_cache, k_in, v, positions, cache_batch_idx, block_table, checked)
    if replayed is not None:
        pointers = {"q": q_in.data_ptr(), "k": k_cache.data_ptr(), "v": v_cache.data_ptr(), "o": out.data_ptr(),
                    "seqused_k": used.data_ptr()}
        if lse is not None:
            pointers["lse"] = lse.data_ptr()
        if cache_batch_idx is not None:
            pointers["cache_batch_idx"] = cache_batch_idx.data_ptr()
        if block_table is not None:
            pointers["block_table"] = block_table.data_ptr()
        for name, t in (("alibi_slopes", score.alibi_slopes), ("sinks", score.sinks)):
            if t is not None:
                pointers[name] = t.data_ptr()
        if kernel and batch:  # the append's own
            pointers.update(k_new=k.data_ptr(), v_new=v.data_ptr(), cache_seqlens=lengths.data_ptr())
            if cos is not None:
                pointers.update(q_src=q.data_ptr(), rotary_cos=cos.data_ptr(), rotary_sin=sin.data_ptr())
        replay.launch(replayed, pointers, q.device)
    elif plan is not None:
        kept = Kept.of(q, cos is not None, bool(kernel) and batch > 0, window_left=window_left,
                       window_right=window_right, softmax_scale=softmax_scale, local=local, cache_len=cache_len,
                       kernel=bool(kernel), fused=fused)
        replay.run(plan, key, tensors, ROLES, extra=kept,
                   before=(launch,) if launch is not None else ())
    elif launch is not None:  # the attention launches nothing: the append alone
        table = route.device_table(q.device)
        drivers.for_platform(table.platform).launch(table.code_object, launch, q.device)
    if leftpad is not None and return_lse:  # the packed [heads, batch * seq_q] as flash-attn's [batch, heads, seq_q]
        lse = lse.view(q.shape[2], batch, seq_q).permute(1, 0, 2).contiguous()
    return out, lse


def _leftpad_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, used: torch.Tensor,
                  leftpad: torch.Tensor, window: tuple[int, int], softmax_scale: float, return_lse: bool,
                  num_splits: int, cache_len: int,
                  score: ScoreOptions = NO_SCORE_OPTIONS) -> tuple[torch.Tensor, torch.Tensor, Plan | None]:
    """A left-padded call as a packed batch over the cache's own rows: sequence b's keys start at
    row b * (batch stride / position stride) + cache_leftpad[b] of the cache and number
    cache_seqlens + seq_new - cache_leftpad (per-sequence key counts), its queries at row b *
    seq_q of q. The kernels read a packed sequence's keys from its offset, so the masks align to
    the end of the keys that are left, as flash-attn's do. (out, lse, plan); the lse [heads,
    batch * seq_q] of a packed call (empty unless asked for); plan None where nothing is launched."""
    batch, seq_q, heads, _ = q.shape
    device = q.device
    if not q.is_contiguous():  # q and out share one set of offsets
        q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((heads, batch * seq_q) if return_lse else (0,), dtype=torch.float32, device=device)
    kv, vv = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # [batch, heads_kv, cache_len, head_dim]
    step, stride_b = kv.stride(2), kv.stride(0)
    per = cache_len
    if batch > 1:
        if v_cache.stride() != k_cache.stride() or step <= 0 or stride_b % step or stride_b // step < cache_len:
            raise UnsupportedError(f"cache_leftpad needs k_cache and v_cache of one layout whose batch stride is a "
                                   f"whole number of positions, at least cache_len; got strides {k_cache.stride()} "
                                   f"and {v_cache.stride()}: pass contiguous caches")
        per = stride_b // step
    if (batch - 1) * per + cache_len > 2**31 - 1:
        raise UnsupportedError(f"cache_leftpad addresses the cache's rows by 32-bit offsets; {batch} rows of "
                               f"{per} positions are beyond them")
    if batch == 0 or out.numel() == 0:
        lse.fill_(float("-inf"))
        return out, lse, None
    starts = _arange(batch, device) * per + leftpad.long()
    cu_k = torch.cat([starts, starts.new_full((1,), (batch - 1) * per + cache_len)]).to(torch.int32)
    cu_q = (_arange(batch + 1, device) * seq_q).to(torch.int32)
    counts = (used.long() - leftpad.long()).clamp(0, cache_len).to(torch.int32)  # keys from cache_leftpad on
    call = route.Attention(q=q.transpose(1, 2), k=kv, v=vv, out=out.transpose(1, 2), lse=lse if return_lse else None,
                           window=window, softmax_scale=softmax_scale, batch=batch, seq_q=seq_q, seq_k=cache_len,
                           seqused_k=counts, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, num_splits=num_splits,
                           softcap=score.softcap, alibi_slopes=score.alibi_slopes, sinks=score.sinks)
    return out, lse, route.plan(route.device_table(device), call)


@torch.library.custom_op("rdnattention::flash_attn_kvcache_fwd", mutates_args=("k_cache", "v_cache"))
def flash_attn_kvcache_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           k: Optional[torch.Tensor], v: Optional[torch.Tensor], rotary_cos: Optional[torch.Tensor],
                           rotary_sin: Optional[torch.Tensor],
                           cache_seqlens: torch.Tensor, cache_batch_idx: Optional[torch.Tensor],
                           block_table: Optional[torch.Tensor], window_left: int, window_right: int,
                           softmax_scale: float, rotary_interleaved: bool, rotary_local: bool, return_lse: bool,
                           num_splits: int, cache_leftpad: Optional[torch.Tensor] = None, softcap: float = 0.0,
                           alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A flash_attn_with_kvcache call that appends or has cache_leftpad, as one custom op
    (validated by the entry point; the implementation checks memory and values, plans, then
    appends and runs, as in eager mode)."""
    score = check_score_options(softcap, alibi_slopes, sinks, batch=q.shape[0], heads_q=q.shape[2], device=q.device)
    return _run(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table,
                window_left, window_right, softmax_scale, rotary_interleaved, rotary_local, return_lse, num_splits,
                leftpad=cache_leftpad, score=score)


@flash_attn_kvcache_fwd.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, block_table, window_left,
      window_right, softmax_scale, rotary_interleaved, rotary_local, return_lse, num_splits, cache_leftpad=None,
      softcap=0.0, alibi_slopes=None, sinks=None):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if return_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)
