"""Calls on caches and packed batches, behind `flash_attn_with_kvcache` (paged caches,
cache_batch_idx, explicit num_splits) and the variable-length entry points (varlen.py): `prepare`
checks such a call against memory and its index values (check_values, where they are read) and
plans it (route.py chooses the kernels: the split-KV ones, or for a packed prefill the row-block
ones compiled for packed batches), `run` runs it and keeps the plan for later calls of its
geometry, which `replayed` runs with the same checks of memory and values; the custom op
`rdnattention::flash_attn_decode_fwd` wraps it for torch.compile and tensor subclasses, so its
implementation checks what an eager call checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from . import checks, ops, options, replay, route
from .errors import InvalidArgumentError, UnsupportedError
from .options import NO_SCORE_OPTIONS, ScoreOptions
from .plan import Plan

# The pointer fields of a call's launches (dec and f16 varlen structs), each filled
# by one tensor.
ROLES = frozenset({"q", "k", "v", "o", "lse", "seqused_k", "block_table", "cache_batch_idx", "cu_seqlens_q",
                   "cu_seqlens_k", "alibi_slopes", "sinks"})


@dataclass(frozen=True)
class Extents:
    """The sizes of a call whose tensors do not say them: q is [batch, seq_q, heads_q, head_dim], or
    packed [total_q, heads_q, head_dim] with cu_seqlens_q; k, v are [batch, seq_k, heads_kv,
    head_dim], packed [total_k, heads_kv, head_dim] with cu_seqlens_k, or a page pool [pages,
    page_size, heads_kv, head_dim] with block_table."""

    batch: int
    seq_q: int  # per batch; packed: the longest
    seq_k: int  # per batch at most; paged: pages per row x page size


def check_values(q, k, *, extents: Extents, seqused_k=None, block_table=None, cache_batch_idx=None,
                 cu_seqlens_q=None, cu_seqlens_k=None, names: Mapping[str, str] | None = None,
                 score: ScoreOptions = NO_SCORE_OPTIONS) -> None:
    """The index tensors' values, in one device read (checks.Values): pages within the pool, cache
    rows within the cache, offsets from 0, never decreasing, within the packed rows and no sequence
    longer than seq_q / seq_k, key counts within seq_k and each sequence's keys; ALiBi slopes and
    sinks finite (``score``). Run by the eager
    entry points and by the custom op's implementation alike, so a compiled call is checked as an
    eager one. ``names``: the entry point's names of the arguments, for messages."""
    def n(name: str) -> str:
        return (names or {}).get(name, name)

    values = checks.Values()
    values.within(n("block_table"), block_table, 0, k.shape[0] - 1)
    values.within(n("cache_batch_idx"), cache_batch_idx, 0, k.shape[0] - 1)
    values.offsets(n("cu_seqlens_q"), cu_seqlens_q, q.shape[0], extents.seq_q, n("seq_q"))
    values.offsets(n("cu_seqlens_k"), cu_seqlens_k, k.shape[0], extents.seq_k, n("seq_k"))
    values.within(n("seqused_k"), seqused_k, 0, extents.seq_k, n("seq_k"))
    if seqused_k is not None and cu_seqlens_k is not None:
        values.at_most(n("seqused_k"), seqused_k, cu_seqlens_k[1:] - cu_seqlens_k[:-1],
                       f"each sequence's keys in {n('cu_seqlens_k')}")
    options.check_score_values(values, score)
    values.check()


def _check_extents(q, k, v, extents: Extents, seqused_k, block_table, cache_batch_idx, cu_seqlens_q,
                   cu_seqlens_k) -> None:
    """The tensors agree with the extents (shapes only): the entry points guarantee it; a direct
    call of the custom op is held to it."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise InvalidArgumentError(f"flash_attn_decode_fwd: {what}")

    batch = extents.batch
    for name, t in (("q", q), ("k", k), ("v", v)):
        need(t.dtype in checks.FLOAT_DTYPES and t.dtype == q.dtype and t.device == q.device and t.dim() in (3, 4),
             f"{name} must be a float16 or bfloat16 tensor (q's dtype) of 3 or 4 dimensions on q's device")
    need(k.shape == v.shape and k.shape[-1] == q.shape[-1] and k.shape[-2] > 0 and q.shape[-2] % k.shape[-2] == 0,
         f"k {tuple(k.shape)} and v {tuple(v.shape)} must have one shape, q's head_dim and a divisor of its heads")
    need(min(batch, extents.seq_q, extents.seq_k) >= 0, f"extents {extents} must not be negative")
    for name, t, shape in (("seqused_k", seqused_k, (batch,)), ("cache_batch_idx", cache_batch_idx, (batch,)),
                           ("cu_seqlens_q", cu_seqlens_q, (batch + 1,)), ("cu_seqlens_k", cu_seqlens_k, (batch + 1,)),
                           ("block_table", block_table, 2)):
        if t is not None:
            checks.check_int32(name, t, shape, q.device)
    if cu_seqlens_q is not None:
        need(q.dim() == 3, "packed q must be [total_q, heads_q, head_dim]")
    else:
        need(q.dim() == 4 and q.shape[0] == batch and q.shape[1] == extents.seq_q,
             f"q {tuple(q.shape)} must be [batch = {batch}, seq_q = {extents.seq_q}, heads_q, head_dim]")
    if block_table is not None:
        page = k.shape[1] if k.dim() == 4 else 0
        need(k.dim() == 4 and cu_seqlens_k is None and cache_batch_idx is None and block_table.shape[0] == batch
             and page > 0 and page & (page - 1) == 0 and extents.seq_k <= block_table.shape[1] * page,
             f"a page pool {tuple(k.shape)} (pages of a power of two rows) with block_table "
             f"{tuple(block_table.shape)} must hold seq_k = {extents.seq_k} keys for each of {batch} sequences")
    elif cu_seqlens_k is not None:
        need(k.dim() == 3 and cache_batch_idx is None, "packed k must be [total_k, heads_kv, head_dim]")
    else:
        need(k.dim() == 4 and extents.seq_k <= k.shape[1] and (cache_batch_idx is not None or k.shape[0] >= batch),
             f"k {tuple(k.shape)} must hold seq_k = {extents.seq_k} keys for each of {batch} sequences")


def prepare(q, k, v, *, window: tuple[int, int], softmax_scale: float, return_lse: bool, extents: Extents,
            seqused_k=None, block_table=None, cache_batch_idx=None, cu_seqlens_q=None, cu_seqlens_k=None,
            num_splits: int = 0, names: Mapping[str, str] | None = None, values_checked: bool = False,
            score: ScoreOptions = NO_SCORE_OPTIONS) -> tuple[torch.Tensor, torch.Tensor, Plan | None]:
    """Checks a validated call against memory and its index values (not where the caller has,
    ``values_checked``) and plans it: (out, lse, plan), plan None where nothing is launched. Nothing
    is launched or written; `run` runs it."""
    packed = cu_seqlens_q is not None
    _check_extents(q, k, v, extents, seqused_k, block_table, cache_batch_idx, cu_seqlens_q, cu_seqlens_k)
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_memory(name, t)
        if t.data_ptr() % 16:
            raise InvalidArgumentError(f"{name} must start on a 16-byte boundary")
    for name, t in (("seqused_k", seqused_k), ("block_table", block_table), ("cache_batch_idx", cache_batch_idx),
                    ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if t is not None:
            checks.check_memory(name, t)
    if not values_checked:
        check_values(q, k, extents=extents, seqused_k=seqused_k, block_table=block_table,
                     cache_batch_idx=cache_batch_idx, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     names=names, score=score)
    else:  # the caller checked the index values, not the score transforms'
        options.check_score_values(checks.Values(), score).check()
    out, lse = allocate(q, return_lse, packed, paged=block_table is not None)
    if packed:  # [1, heads, total, head_dim] views
        qv, ov = q.unsqueeze(0).transpose(1, 2), out.unsqueeze(0).transpose(1, 2)
    else:
        qv, ov = q.transpose(1, 2), out.transpose(1, 2)
    if block_table is not None or k.dim() == 4:
        kv_, vv = k.transpose(1, 2), v.transpose(1, 2)  # [pages or batch, heads_kv, rows, head_dim]
    else:
        kv_, vv = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)
    if extents.batch == 0 or out.numel() == 0:
        out.zero_()  # packed rows that no sequence covers (no batch: every row)
        lse.fill_(float("-inf"))
        return out, lse, None
    call = route.Attention(q=qv, k=kv_, v=vv, out=ov, lse=lse if return_lse else None, window=window,
                           softmax_scale=softmax_scale, batch=extents.batch, seq_q=extents.seq_q,
                           seq_k=extents.seq_k, seqused_k=seqused_k, cache_batch_idx=cache_batch_idx,
                           block_table=block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           num_splits=num_splits, softcap=score.softcap, alibi_slopes=score.alibi_slopes,
                           sinks=score.sinks)
    return out, lse, route.plan(route.device_table(q.device), call)


def run(q, k, v, *, key: tuple | None = None, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks, plans and runs a validated call (shapes checked by the caller; `prepare` takes the
    arguments); returns (out, lse) in the layout of q (lse: [batch, heads_q, seq_q], packed
    [heads_q, total_q]; empty unless asked for). With ``key`` (replay.key of the entry point's
    call), the plan is kept for later calls of that key (replayed)."""
    out, lse, plan = prepare(q, k, v, **kw)
    if plan is not None:
        replay.run(plan, key, _tensors(q, k, v, kw), ROLES)
    return out, lse


def _tensors(q, k, v, kw) -> tuple:
    """The tensors a replay checks per call, in replayed's order."""
    score = kw.get("score", NO_SCORE_OPTIONS)
    return (q, k, v, kw.get("seqused_k"), kw.get("block_table"), kw.get("cache_batch_idx"), kw.get("cu_seqlens_q"),
            kw.get("cu_seqlens_k"), *score.tensors)


_POINTERS = ("q", "k", "v", "seqused_k", "block_table", "cache_batch_idx", "cu_seqlens_q", "cu_seqlens_k",
             "alibi_slopes", "sinks")


def replayed(r: replay.Replay, q, k, v, *, seqused_k=None, block_table=None, cache_batch_idx=None,
             cu_seqlens_q=None, cu_seqlens_k=None, return_lse: bool, check=None,
             score: ScoreOptions = NO_SCORE_OPTIONS) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The outputs of a call whose key was planned before (run's tensors), replayed on ``r`` (the
    replay kept for it): its memory checked as prepare checks it, and its index values by
    ``check()`` (the entry point's check_values) where they are read, and the slopes' and sinks'
    (``score``) likewise; None where its memory needs the full path (which raises the error)."""
    tensors = (q, k, v, seqused_k, block_table, cache_batch_idx, cu_seqlens_q, cu_seqlens_k, *score.tensors)
    found = replay.pointers(tensors, r.reach, 3)
    if found is None:
        return None
    if check is not None and checks.reads(q):
        check()
    if score.alibi_slopes is not None or score.sinks is not None:
        values = checks.Values()
        for name, t in (("alibi_slopes", score.alibi_slopes), ("sinks", score.sinks)):
            values.finite(name, t)
        values.check()
    packed = cu_seqlens_q is not None
    out, lse = allocate(q, False, packed, empty_lse=False, paged=block_table is not None)
    if return_lse:  # allocate's LSE, from a stand-in
        like = r.like or replay.keep_stand_ins(
            r, q.device, ((q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1]), torch.float32))
        lse = torch.empty_like(like[0], memory_format=replay.CONTIGUOUS)
    pointers = dict(zip(_POINTERS, found))  # (absent ones are no field of the launches)
    pointers["o"] = out.data_ptr()
    if lse is not None:
        pointers["lse"] = lse.data_ptr()
    replay.launch(r, pointers, q.device)
    return out, lse


def allocate(q: torch.Tensor, return_lse: bool, packed: bool, empty_lse: bool = True,
             paged: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output in q's layout and the LSE (when not asked for: an empty tensor, or None where
    ``empty_lse`` is false). Packed, the rows past the last sequence are zero: the kernels write them
    (fa2_zero_rows_past_sequences) except the paged ones, so a ``paged`` packed output is zero-filled
    here; a call that launches nothing zeroes its output (prepare, Plan.returning)."""
    out = (torch.zeros_like if packed and paged else torch.empty_like)(q, memory_format=torch.contiguous_format)
    if not return_lse:
        return out, q.new_empty((0,), dtype=torch.float32) if empty_lse else None
    if packed:
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def forward(q, k, v, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """`run` (``key``: see run), through the custom op where torch traces or the tensors are
    subclasses."""
    score = kw.get("score", NO_SCORE_OPTIONS)
    tensors = [t for t in (q, k, v, kw.get("seqused_k"), kw.get("block_table"), kw.get("cache_batch_idx"),
                           kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k"), *score.tensors) if t is not None]
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or not all(type(t) is torch.Tensor for t in tensors)):
        # The op's implementation checks the index values itself (with the op's argument names).
        extents = kw["extents"]
        return flash_attn_decode_fwd(q, k, v, kw.get("seqused_k"), kw.get("block_table"), kw.get("cache_batch_idx"),
                                     kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k"), extents.batch, extents.seq_q,
                                     extents.seq_k, kw["window"][0], kw["window"][1], kw["softmax_scale"],
                                     kw["return_lse"], kw.get("num_splits", 0), score.softcap, score.alibi_slopes,
                                     score.sinks)
    return run(q, k, v, **kw)


@torch.library.custom_op("rdnattention::flash_attn_decode_fwd", mutates_args=())
def flash_attn_decode_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqused_k: Optional[torch.Tensor],
                          block_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
                          cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], batch: int,
                          seq_q: int, seq_k: int, window_left: int, window_right: int, softmax_scale: float,
                          return_lse: bool, num_splits: int, softcap: float = 0.0,
                          alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
                          deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic: read by the backward alone (_setup_context)
    heads_q = q.shape[-2]
    score = options.check_score_options(softcap, alibi_slopes, sinks, batch=batch, heads_q=heads_q, device=q.device)
    return run(q, k, v, window=(window_left, window_right), softmax_scale=softmax_scale, return_lse=return_lse,
               extents=Extents(batch=batch, seq_q=seq_q, seq_k=seq_k), seqused_k=seqused_k, block_table=block_table,
               cache_batch_idx=cache_batch_idx, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
               num_splits=num_splits, score=score)


@flash_attn_decode_fwd.register_fake
def _(q, k, v, seqused_k, block_table, cache_batch_idx, cu_seqlens_q, cu_seqlens_k, batch, seq_q, seq_k,
      window_left, window_right, softmax_scale, return_lse, num_splits, softcap=0.0, alibi_slopes=None, sinks=None,
      deterministic=False):
    return allocate(q, return_lse, cu_seqlens_q is not None)


# The backward of packed sequences (varlen.py records the op where autograd does): the bwd family's
# passes over the sequences (ops.flash_attn_varlen_bwd), from the saved q, k, v, output and
# log-sum-exp, with each sequence's key counts where given. The op's other uses (caches, pages)
# have none, and say so when asked.

def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, seqused_k, block_table, cache_batch_idx, cu_seqlens_q, cu_seqlens_k, batch, seq_q, seq_k,
     window_left, window_right, softmax_scale, return_lse, num_splits, softcap, alibi_slopes, sinks,
     deterministic) = inputs
    out, lse = output
    ctx.unserved = [name for name, present in (
        ("block_table", block_table is not None),
        ("cache_batch_idx", cache_batch_idx is not None), ("cu_seqlens_q=None", cu_seqlens_q is None),
        ("cu_seqlens_k=None", cu_seqlens_k is None), ("return_lse=False", not return_lse)) if present]
    ctx.options = (seq_q, seq_k, window_left, window_right, softmax_scale, softcap, deterministic)
    ctx.alibi = alibi_slopes is not None
    ctx.sinks = sinks is not None
    ctx.seqused = seqused_k is not None
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                          *((alibi_slopes,) if alibi_slopes is not None else ()),
                          *((sinks,) if sinks is not None else ()),
                          *((seqused_k,) if seqused_k is not None else ()))


def _backward(ctx, dout, dlse):
    if ctx.unserved:
        raise UnsupportedError(f"rdnattention::flash_attn_decode_fwd has a backward for packed sequences alone, not "
                               f"with {', '.join(ctx.unserved)}")
    q, k, v, out, lse, cu_q, cu_k, *rest = ctx.saved_tensors
    slopes = rest.pop(0) if ctx.alibi else None
    sinks = rest.pop(0) if ctx.sinks else None
    seqused_k = rest.pop(0) if ctx.seqused else None
    seq_q, seq_k, left, right, scale, softcap, deterministic = ctx.options
    # With sinks, the log-sum-exp holds each row's sink: the kernels' gradients of q, k and v are
    # those of the call as they are (ops._backward); the sinks' own is ops._sink_gradient's.
    dq = dk = dv = None
    if any(ctx.needs_input_grad[:3]):  # (learned sinks alone need none of the passes)
        dq, dk, dv = ops.flash_attn_varlen_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, seq_q, seq_k, left, right,
                                           scale, softcap, deterministic, slopes, seqused_k)
    dsinks = (ops._sink_gradient(sinks, dout, out, lse, dlse, cu_seqlens_q=cu_q)
              if ctx.sinks and ctx.needs_input_grad[18] else None)
    return (dq, dk, dv) + (None,) * 15 + (dsinks, None)


flash_attn_decode_fwd.register_autograd(_backward, setup_context=_setup_context)
