"""The fp16 forward on [batch, heads, seq, head_dim] views, as the entry points in api.py (and
flash_attn_with_kvcache's plain caches) run it once they have validated a call (options.py):
planned here, the kernel chosen by route.py, and run directly in eager mode (the plan kept for
later calls of the same key and replayed: key, replayed) or through the custom op
``rdnattention::flash_attn_fwd`` where torch traces or the tensors are subclasses, so compiled
graphs need no break. The op has a fake implementation and torch.library.opcheck holds. Its
arguments are the kernel's: q, k, v as [batch, heads, seq, head_dim] views, the window after
folding causal in, the softmax scale, RoPE tables or None, whether to return the log-sum-exp,
whether the output is stored token-major ([batch, seq, heads, head_dim], returned as the
[batch, heads, seq, head_dim] view of it), per-sequence key counts or None, and the score
transforms (softcap, ALiBi slopes or None, sinks or None)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from . import checks, options, replay, route
from .call import DTYPE_OPTIONS
from .errors import InvalidArgumentError, UnsupportedError
from .families import bwd
from .options import Options
from .plan import Plan
from .tally import Tally

log = logging.getLogger("rdnattention")


def allocate(q: torch.Tensor, token_major: bool, return_lse: bool,
             empty_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output in the caller's layout, as the kernel's [batch, heads, seq, head_dim] view, and the
    log-sum-exp (when not asked for: an empty tensor, or None where ``empty_lse`` is false)."""
    batch, heads, seq, dim = q.shape
    if token_major:
        out = q.new_empty((batch, seq, heads, dim)).transpose(1, 2)
    else:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [batch, heads, seq, dim]
    if not (return_lse or empty_lse):
        return out, None
    lse_shape = (batch, heads, seq) if return_lse else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


def plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: Options, token_major: bool,
         heavy_first: bool | None = None, kernel: str | None = None, values_checked: bool = False) -> Plan:
    """A validated call planned: memory and cache lengths checked (the lengths' values not where the
    caller has, ``values_checked``), outputs allocated, kernel chosen."""
    for name, t in (("q", q), ("k", k), ("v", v), ("rotary_cos", o.rotary_cos), ("rotary_sin", o.rotary_sin)):
        if t is None:
            continue
        checks.check_memory(name, t)
        if name in "qkv" and t.data_ptr() % 16:
            raise InvalidArgumentError(
                f"{name} rows must start on 16-byte boundaries: strides {t.stride()[:3]} must be multiples of 8 "
                f"elements and the data pointer 16-byte aligned")
    cos, sin = o.rotary_cos, o.rotary_sin
    if cos is not None and cos.dtype != torch.float32:  # q's dtype: the kernel reads fp32 tables
        cos, sin = cos.float(), sin.float()
    if o.seqused_k is not None:
        checks.check_memory("seqused_k", o.seqused_k)
    values = checks.Values()
    if o.seqused_k is not None and not values_checked:
        values.within("seqused_k", o.seqused_k, 0, k.shape[2], "seq_k")
    options.check_score_values(values, o.score).check()
    out, lse = allocate(q, token_major, o.return_lse)
    call = route.Attention(q=q, k=k, v=v, out=out, lse=lse if o.return_lse else None,
                           window=(o.window_left, o.window_right), softmax_scale=o.softmax_scale,
                           batch=q.shape[0], seq_q=q.shape[2], seq_k=k.shape[2], seqused_k=o.seqused_k,
                           rotary_cos=cos, rotary_sin=sin, rotary_interleaved=o.rotary_interleaved,
                           heavy_first=heavy_first, kernel=kernel, softcap=o.score.softcap,
                           alibi_slopes=o.score.alibi_slopes, sinks=o.score.sinks)
    empty = out.numel() == 0 or k.shape[2] == 0
    return route.plan(route.device_table(q.device), call).returning(out, lse, empty=empty, sinks=o.score.sinks)


# The pointer fields of a call's launches (f16 and dec structs), each filled by one tensor.
ROLES = frozenset({"q", "k", "v", "o", "lse", "seqused_k", "rotary_cos", "rotary_sin", "alibi_slopes", "sinks"})


def key(q, k, v, *, is_causal, window_size, softmax_scale, return_lse, token_major: bool, rotary_cos=None,
        rotary_sin=None, rotary_interleaved=False, seqused_k=None, softcap=0.0, alibi_slopes=None,
        sinks=None, views: bool = False) -> tuple | None:
    """The replay key of a flash_attn-like call (replay.key), or None where its options are not of
    the types validation accepts (the full path refuses them): q, k, v as the entry point takes
    them, token-major where ``token_major`` (the output's layout) unless ``views`` (they are the
    kernel's [batch, heads, seq, head_dim] views, the output token-major all the same). The
    softcap is in it with its type (its value is in the planned arguments), the slopes and sinks
    by their shapes, strides, dtypes and devices, as every tensor."""
    if (type(is_causal) is not bool or type(return_lse) is not bool or type(rotary_interleaved) is not bool
            or type(window_size) is not tuple or len(window_size) != 2 or type(window_size[0]) is not int
            or type(window_size[1]) is not int or type(q) is not torch.Tensor):
        return None
    layout = VIEWS_TOKEN_MAJOR if views and token_major else token_major
    return replay.key("flash_attn", q.device, (q, k, v, rotary_cos, rotary_sin, seqused_k, alibi_slopes, sinks),
                      (is_causal, window_size, type(softmax_scale), softmax_scale, return_lse, layout,
                       rotary_interleaved, type(softcap), softcap))


# key()'s layout of a call whose tensors are the kernel's views and whose output is token-major
# (transformers' attention function: its query, key and value are [batch, heads, seq, head_dim]
# and it returns [batch, seq, heads, head_dim]).
VIEWS_TOKEN_MAJOR = "views, token-major output"


def length_free(key: tuple | None) -> tuple | None:
    """The key (of :func:`key`) of the calls whose plan follows this one's keys' length
    (replay.length_free: K and V at their places among the tensors, their length along the
    sequence dimension of the key's layout), or None where validation reads that length: RoPE
    tables (their positions must cover the keys) and a window with a finite left extent (clamped to
    the keys' length: options.validate)."""
    if key is None or key[1][1][0] >= 0 or key[5] is not None or key[6] is not None:
        return None
    return replay.length_free(key, KV, seq_dim(key))


# K's and V's places among key()'s tensors
KV = (1, 2)


def seq_dim(key: tuple) -> int:
    """The dimension of K's and V's length in the layout of the call of ``key`` (of :func:`key`)."""
    return 1 if key[1][5] is True else 2


def replayed(key: tuple | None, q, k, v, *, return_lse: bool, token_major: bool, rotary_cos=None, rotary_sin=None,
             seqused_k=None, alibi_slopes=None, sinks=None,
             views: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The outputs of a call whose key was planned before, replayed, in the caller's layout (q, k,
    v as the key saw them: token-major ones [batch, seq, heads, head_dim], unless ``views``);
    None where it was not, or where its memory needs the full path (which raises the error). The
    output is [batch, seq, heads, head_dim] where ``token_major``."""
    if key is None:
        return None
    tensors = (q, k, v, rotary_cos, rotary_sin, seqused_k, alibi_slopes, sinks)
    followed, f = replay._followed  # a by_length entry's guard made this key: one of its calls, of any length
    r = replay.follow(f, key, tensors, q.device) if followed is key else None
    if r is None:
        r = replay.lookup(key)  # (None for an unhashable option, a list for a number: the full path names it)
    if r is None:  # a call that differs from a kept one in the keys' length alone follows its replay
        free = length_free(key)
        if free is None:
            return None
        try:
            f = replay.by_length.get(free)
        except TypeError:  # an option that is not hashable (replay.lookup)
            return None
        if f is None:
            return None
        r = replay.follow(f, key, tensors, q.device)
        if r is None:
            return None  # planned in full
    found = replay.pointers(tensors, r.reach, 3)
    if found is None:
        return None
    if seqused_k is not None or alibi_slopes is not None or sinks is not None:
        values = checks.Values()
        if seqused_k is not None:
            values.within("seqused_k", seqused_k, 0, k.shape[2], "seq_k")
        for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
            values.finite(name, t)  # where read (checks.reads), as the full path
        values.check()
    like = r.like or replay.keep_stand_ins(r, q.device, *_outputs(q, token_major, views, return_lse))
    out = torch.empty_like(q) if like[0] is None else torch.empty_like(like[0], memory_format=replay.CONTIGUOUS)
    lse = torch.empty_like(like[1], memory_format=replay.CONTIGUOUS) if return_lse else None
    pointers = {"q": found[0], "k": found[1], "v": found[2], "o": out.data_ptr()}
    if lse is not None:
        pointers["lse"] = lse.data_ptr()
    if seqused_k is not None or alibi_slopes is not None or sinks is not None:
        pointers["seqused_k"], pointers["alibi_slopes"], pointers["sinks"] = found[5:]
    if rotary_cos is not None:
        if rotary_cos.dtype != torch.float32:  # q's dtype: the kernel reads fp32 tables
            rotary_cos, rotary_sin = rotary_cos.float(), rotary_sin.float()
            pointers["rotary_cos"], pointers["rotary_sin"] = rotary_cos.data_ptr(), rotary_sin.data_ptr()
        else:
            pointers["rotary_cos"], pointers["rotary_sin"] = found[3], found[4]
    replay.launch(r, pointers, q.device)
    return out, lse


def _outputs(q: torch.Tensor, token_major: bool, views: bool, return_lse: bool) -> tuple:
    """replayed's outputs, as replay.keep_stand_ins takes them: the output [batch, seq, heads,
    head_dim] where token-major, else [batch, heads, seq, head_dim] (None: empty_like(q), which keeps
    a contiguous q's strides and costs less), and the LSE [batch, heads, seq] if asked for."""
    if token_major:
        batch, seq, heads, dim = (q.shape[0], q.shape[2], q.shape[1], q.shape[3]) if views else q.shape
        out = ((batch, seq, heads, dim), q.dtype)
    else:
        batch, heads, seq, dim = q.shape
        out = None if q.is_contiguous() else (q.shape, q.dtype)
    return out, ((batch, heads, seq), torch.float32) if return_lse else None


def grad_needed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None = None) -> bool:
    """Whether autograd records a call on q, k and v (and sinks): grad mode is on and one of them
    requires grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: Options, token_major: bool,
            key: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs a validated call: directly in eager mode, through the custom op where torch traces or
    autograd records it (the op then returns the log-sum-exp, which its backward reads, whether or
    not the call asked for it). With ``key`` (ops.key of the same call), the plan is kept for later
    calls of that key."""
    grad = grad_needed(q, k, v, o.score.sinks)
    if grad and not torch.compiler.is_compiling():
        check_backward_built(q)
    if grad and o.rotary_cos is not None:  # the backward kernels take no RoPE: q and k rotated before them
        q, k, o = rotated(q, k, o)
    if (grad or torch.compiler.is_compiling() or torch.jit.is_tracing()
            or not (type(q) is type(k) is type(v) is torch.Tensor)):
        return flash_attn_fwd(q, k, v, o.rotary_cos, o.rotary_sin, o.window_left, o.window_right, o.softmax_scale,
                              o.rotary_interleaved, o.return_lse or grad, token_major, o.seqused_k, o.score.softcap,
                              o.score.alibi_slopes, o.score.sinks, o.deterministic)
    p = plan(q, k, v, o, token_major)
    replay.run(p, key, (q, k, v, o.rotary_cos, o.rotary_sin, o.seqused_k, *o.score.tensors), ROLES,
               free=_following(key))
    return p.outputs


def _following(key: tuple | None) -> tuple | None:
    """replay.remember's ``free`` of the call ``key``: its length_free key, K's and V's places, the
    dimension of their length; None where validation reads the length."""
    free = length_free(key)
    return None if free is None else (free, KV, seq_dim(key))


# RoPE with gradients: the backward kernels take no rotation, so a call that autograd records has q
# and k rotated by torch operations (differentiable: autograd takes the gradients back through the
# rotation) and runs the kernels without RoPE. It pays a rotated copy of q and k; each such call is
# counted (backward_counts' "rotary") and the first logs one line.
_rotary = Tally()


def rotated(q: torch.Tensor, k: torch.Tensor, o: Options) -> tuple[torch.Tensor, torch.Tensor, Options]:
    """q and k ([batch, heads, seq, head_dim] views) rotated as the kernels rotate them: keys at
    positions 0 .. seq_k - 1, query i at i + n - seq_q where n is its sequence's key count (seq_k,
    or seqused_k's; a query before the first key is not rotated); the first 2 * rotary_cos.shape[1]
    features, interleaved pairs or halves as ``o.rotary_interleaved``; in fp32, rounded once to
    q's dtype. Returns them with ``o`` without its RoPE tables."""
    if not torch.compiler.is_compiling() and _rotary.add("rotary"):  # (traced calls are not counted)
        log.warning("rdnattention: RoPE in a call that requires grad: q and k are rotated by torch operations "
                    "before the kernels (the backward kernels take no rotation)")
    cos, sin = o.rotary_cos.float(), o.rotary_sin.float()
    seq_q, seq_k = q.shape[2], k.shape[2]
    queries = torch.arange(seq_q, device=q.device)
    if o.seqused_k is None:
        queries = queries + (seq_k - seq_q)  # [seq_q]
    else:
        queries = queries + (o.seqused_k.long()[:, None] - seq_q)  # [batch, seq_q]: each sequence's own
    keys = torch.arange(seq_k, device=q.device)
    q = _rope(q, cos, sin, queries, o.rotary_interleaved)
    k = _rope(k, cos, sin, keys, o.rotary_interleaved)
    return q, k, dataclasses.replace(o, rotary_cos=None, rotary_sin=None, rotary_interleaved=False)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
          interleaved: bool) -> torch.Tensor:
    """x [batch, heads, seq, head_dim] rotated at ``positions`` ([seq], or [batch, seq]; below 0:
    not rotated), differentiably."""
    half = cos.shape[1]
    before = positions < 0
    c, s = cos[positions.clamp(min=0)], sin[positions.clamp(min=0)]  # [..., seq, half]
    c = torch.where(before[..., None], 1.0, c)
    s = torch.where(before[..., None], 0.0, s)
    if positions.dim() == 2:
        c, s = c[:, None], s[:, None]  # over the heads
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0:2 * half:2], xf[..., 1:2 * half:2]
        turned = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., :half], xf[..., half:2 * half]
        turned = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((turned, xf[..., 2 * half:]), dim=-1).to(x.dtype)


@torch.library.custom_op("rdnattention::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary_cos: Optional[torch.Tensor],
                   rotary_sin: Optional[torch.Tensor], window_left: int, window_right: int, softmax_scale: float,
                   rotary_interleaved: bool, return_lse: bool, token_major: bool,
                   seqused_k: Optional[torch.Tensor] = None, softcap: float = 0.0,
                   alibi_slopes: Optional[torch.Tensor] = None,
                   sinks: Optional[torch.Tensor] = None, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic: read by the backward alone (_setup_context)
    score = options.check_score_options(softcap, alibi_slopes, sinks, batch=q.shape[0], heads_q=q.shape[1],
                                        device=q.device, sinks_grad=True)
    o = Options(window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
                rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                return_lse=return_lse, seqused_k=seqused_k, score=score)
    p = plan(q, k, v, o, token_major)
    p.run()
    return p.outputs


@flash_attn_fwd.register_fake
def _(q, k, v, rotary_cos, rotary_sin, window_left, window_right, softmax_scale, rotary_interleaved, return_lse,
      token_major, seqused_k=None, softcap=0.0, alibi_slopes=None, sinks=None, deterministic=False):
    return allocate(q, token_major, return_lse)


# --- the backward pass ----------------------------------------------------------------------------
# flash_attn_fwd's gradients: rdnattention::flash_attn_bwd (the bwd family's three passes,
# families/bwd.py) from the saved q, k, v, output and log-sum-exp. Calls whose options the backward
# kernels do not take are refused when autograd records them (options.validate), naming the option.

# A head_dim without backward kernels of its own runs those of the next head_dim built for its
# dtype, on copies of q, k, v, the output and its gradient padded with zero columns: a zero column
# adds nothing to a score, to rowsum(dO * O) or to any other column's gradient, and its own gradient
# columns are sliced off. The call pays the copies and the wider kernel's work; each is counted by
# (target, dtype, head_dims) (backward_counts, rdnattention.stats()["backward"]), and the first of
# each logs one line.
_padded = Tally()


def backward_head_dim(table, head_dim: int, dtype: str | None, passes: tuple = bwd.DETERMINISTIC) -> int | None:
    """The head_dim whose backward kernels (``passes``) serve a call of ``head_dim`` in ``dtype`` on
    ``table``'s target: its own where they are built, else the next one built (the call padded to
    it), or None where none is."""
    if bwd.served(table, head_dim, dtype, passes):
        return head_dim
    return next((d for d in table.head_dims(bwd.NAME, None, dtype) if d > head_dim and bwd.served(table, d, dtype, passes)),
                None)


def backward_missing(table, q: torch.Tensor) -> str | None:
    """Why ``table``'s target cannot run the backward of a call on q (no backward kernel for its
    head_dim and dtype, nor for a larger head_dim to pad it to), or None: the one check the entry
    points and the integrations share."""
    dtype = DTYPE_OPTIONS.get(str(q.dtype))
    if backward_head_dim(table, q.shape[-1], dtype) is not None:
        return None
    return (f"{table.target} has no backward kernel for {'bf16' if dtype else 'fp16'} head_dim {q.shape[-1]} "
            f"or above (built head_dims: {table.head_dims(bwd.NAME, None, dtype)})")


def backward_counts(*, reset: bool = False) -> dict:
    """The backward calls that took a detour: ``{"padded": calls run padded to a larger head_dim,
    "head_dims": {"<target> <dtype> head_dim <d> -> <padded>": calls}, "rotary": calls whose RoPE
    torch operations applied (rotated)}`` (a copy; also ``rdnattention.stats()["backward"]``). With
    ``reset=True`` the counts start again from zero, and each logs again."""
    _, head_dims = _padded.read(reset=reset)
    rotary = _rotary.read(reset=reset)[1].get("rotary", 0)
    return {"padded": sum(head_dims.values()), "head_dims": head_dims, "rotary": rotary}


def _count_padded(table, dtype: str | None, head_dim: int, padded: int) -> None:
    reason = f"{table.target} {'bf16' if dtype else 'fp16'} head_dim {head_dim} -> {padded}"
    if _padded.add(reason):
        log.warning("rdnattention: no backward kernel for %s head_dim %d on %s; its backward runs the head_dim %d "
                    "kernels on copies padded with zero columns", "bf16" if dtype else "fp16", head_dim, table.target,
                    padded)


def check_backward_built(q: torch.Tensor) -> None:
    """UnsupportedError where q's device has no backward kernel for its head_dim and dtype."""
    why = backward_missing(route.device_table(q.device), q)
    if why:
        raise UnsupportedError(f"q, k or v requires grad, and {why}; run the call under torch.no_grad(), or pass "
                               "detached tensors")


def _readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the kernels can read its rows (last dimension contiguous, rows on 16 bytes), else a
    contiguous copy (an output's gradient may be expanded, with zero strides)."""
    per16 = 16 // t.element_size()
    stride = t.stride()
    if (stride[3] != 1 and t.shape[3] > 1) or any(s % per16 for s in stride[:3]) or t.data_ptr() % 16:
        return t.contiguous()
    return t


def atomic_backward(table, q: torch.Tensor, deterministic: bool) -> bool:
    """Whether a backward on q takes the atomic passes (bwd.ATOMIC: dQ added into an fp32 sum by
    atomics, one recomputation fewer; its last bits may vary run to run): where ``table``'s target
    has them for q's head_dim and dtype, it is not an AMD target (the atomic passes are timed on
    NVIDIA alone; on AMD's RDNA3 and later they are built and emulator-tested, and taken by
    ``backward(..., atomic=True)``), and neither ``deterministic`` nor
    torch.use_deterministic_algorithms asks for one order."""
    return (not deterministic and not torch.are_deterministic_algorithms_enabled()
            and table.platform != "amdgcn"
            and bwd.served(table, q.shape[-1], DTYPE_OPTIONS.get(str(q.dtype)), bwd.ATOMIC))  # (q as padded)


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, dlse: torch.Tensor | None, window_left: int, window_right: int,
             softmax_scale: float, softcap: float, deterministic: bool = False,
             kernels: tuple = (None, None, None), atomic: bool | None = None, alibi_slopes=None,
             packed: tuple | None = None, seqused_k: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (each laid out as its input) of a forward call's output ``out`` and log-sum-exp
    ``lse`` against their gradients ``dout`` and ``dlse`` (None: none). The passes: atomic or
    deterministic as ``atomic`` says (None: atomic_backward's choice); ``kernels`` forces each pass's
    kernel by name (bwd.plan). ``alibi_slopes``: the forward's, or None. ``packed`` =
    (cu_seqlens_q, cu_seqlens_k, max_q, max_k): q, out, dout [total_q, heads_q, head_dim], k, v
    [total_k, heads_kv, head_dim], lse and dlse [heads_q, total_q], as the varlen forward's.
    ``seqused_k``: the forward's (int32 [batch], or None); the keys past each sequence's get zero
    gradients. A head_dim without backward kernels runs the next built one's on padded copies
    (backward_head_dim)."""
    if q.numel() == 0 or k.numel() == 0:  # no rows or no keys: nothing depends on anything
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    head_dim = padded = q.shape[-1]
    given = q, k, v
    if kernels == (None, None, None):
        table = route.device_table(q.device)
        dtype = DTYPE_OPTIONS.get(str(q.dtype))
        padded = backward_head_dim(table, head_dim, dtype) or head_dim  # None: bwd.plan names the missing kernel
        if padded != head_dim and dout.shape == q.shape:  # (a dout of another shape: backward_plan's error)
            _count_padded(table, dtype, head_dim, padded)
            q, k, v, out, dout = (F.pad(t, (0, padded - head_dim)) for t in (q, k, v, out, dout))
    p = backward_plan(dout, q, k, v, out, lse, dlse, window_left, window_right, softmax_scale, softcap,
                      deterministic, kernels, atomic, alibi_slopes, packed, seqused_k)
    p.run()
    if q.shape[-1] != head_dim:  # laid out as the inputs, as the fake implementation says (torch.empty_like)
        return tuple(torch.empty_like(t).copy_(g[..., :head_dim]) for t, g in zip(given, p.outputs))
    return p.outputs


def _sequence_view(t: torch.Tensor | None) -> torch.Tensor | None:
    """A packed tensor [total, heads, ...] as the kernels' [1, heads, total, ...] view (nothing copied)."""
    return None if t is None else t.unsqueeze(0).transpose(1, 2)


def backward_plan(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dlse: torch.Tensor | None, window_left: int, window_right: int,
                  softmax_scale: float, softcap: float, deterministic: bool = False,
                  kernels: tuple = (None, None, None), atomic: bool | None = None, alibi_slopes=None,
                  packed: tuple | None = None, seqused_k: torch.Tensor | None = None) -> Plan:
    """backward's three launches, planned and not run (the tuner times them), on rows and keys
    that exist: its gradients and scratch allocated, the outputs the plan's (packed: in the packed
    layout, zero in the rows of no sequence)."""
    if dout.dtype != q.dtype or tuple(dout.shape) != tuple(q.shape):
        raise InvalidArgumentError(f"the output's gradient must be {q.dtype} {tuple(q.shape)}, got {dout.dtype} "
                                   f"{tuple(dout.shape)}")
    if dlse is not None:  # read by rows as lse (an expanded gradient has zero strides)
        dlse = dlse.float().contiguous()
    if packed is not None:
        # Rows of no sequence get no gradient from the kernels: zero, as each of their rows is.
        grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dq, dk, dv = (_sequence_view(t) for t in grads)
        q, k, v, out, dout = (_sequence_view(t) for t in (q, k, v, out, dout))
        lse, dlse = lse.unsqueeze(0), None if dlse is None else dlse.unsqueeze(0)
    else:
        dq = torch.empty_like(q)
        # Keys past a sequence's seqused_k get no gradient from the kernels: zero.
        dk, dv = (torch.empty_like(t) if seqused_k is None else torch.zeros_like(t) for t in (k, v))
    dout = _readable(dout)
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    table = route.device_table(q.device)
    if atomic is None:
        atomic = atomic_backward(table, q, deterministic)
    dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device) if atomic else None  # zeroed by the kernels
    p = bwd.plan(table, dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse, delta=delta, dq=dq, dk=dk, dv=dv,
                 window=(window_left, window_right), softmax_scale=softmax_scale, softcap=softcap,
                 dtype=DTYPE_OPTIONS.get(str(q.dtype)), dq_accum=dq_accum, alibi_slopes=alibi_slopes, packed=packed,
                 seqused_k=seqused_k, kernels=kernels)
    if packed is not None:
        p.outputs = grads
    return p


@torch.library.custom_op("rdnattention::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dlse: Optional[torch.Tensor], window_left: int, window_right: int,
                   softmax_scale: float, softcap: float = 0.0, deterministic: bool = False,
                   alibi_slopes: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(dout, q, k, v, out, lse, dlse, window_left, window_right, softmax_scale, softcap, deterministic,
                    alibi_slopes=alibi_slopes, seqused_k=seqused_k)


@flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, window_left, window_right, softmax_scale, softcap=0.0, deterministic=False,
      alibi_slopes=None, seqused_k=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op("rdnattention::flash_attn_varlen_bwd", mutates_args=())
def flash_attn_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, dlse: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, window_left: int,
                          window_right: int, softmax_scale: float, softcap: float = 0.0,
                          deterministic: bool = False, alibi_slopes: Optional[torch.Tensor] = None,
                          seqused_k: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of packed sequences (flash_attn_varlen_func's layout): q, out, dout [total_q,
    heads_q, head_dim], k, v [total_k, heads_kv, head_dim], lse and dlse [heads_q, total_q];
    ``seqused_k`` (int32 [batch], or None): the keys each sequence uses, its first ones, as the
    forward's (the others get zero gradients)."""
    return backward(dout, q, k, v, out, lse, dlse, window_left, window_right, softmax_scale, softcap, deterministic,
                    alibi_slopes=alibi_slopes, packed=(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                    seqused_k=seqused_k)


@flash_attn_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left,
      window_right, softmax_scale, softcap=0.0, deterministic=False, alibi_slopes=None, seqused_k=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, rotary_cos, _, window_left, window_right, softmax_scale, _, return_lse, _, seqused_k, softcap,
     alibi_slopes, sinks, deterministic) = inputs
    out, lse = output
    # What the backward kernels do not take (options.validate refuses these calls up front; the op
    # called directly is refused here, when its gradient is asked for).
    unserved = [name for name, present in (("rotary_cos", rotary_cos is not None),
                                           ("return_lse=False", not return_lse)) if present]
    ctx.unserved = unserved
    ctx.options = (window_left, window_right, softmax_scale, softcap, deterministic)
    ctx.sinks = sinks is not None
    ctx.alibi = alibi_slopes is not None
    ctx.seqused = seqused_k is not None
    ctx.save_for_backward(q, k, v, out, lse, *((sinks,) if sinks is not None else ()),
                          *((alibi_slopes,) if alibi_slopes is not None else ()),
                          *((seqused_k,) if seqused_k is not None else ()))


def _backward(ctx, dout, dlse):
    if ctx.unserved:
        raise UnsupportedError(f"rdnattention::flash_attn_fwd has no backward with {', '.join(ctx.unserved)}: the "
                               "backward kernels recompute the probabilities from the log-sum-exp, without RoPE")
    q, k, v, out, lse, *rest = ctx.saved_tensors
    sinks = rest.pop(0) if ctx.sinks else None
    slopes = rest.pop(0) if ctx.alibi else None
    seqused_k = rest.pop(0) if ctx.seqused else None
    # With sinks, the log-sum-exp holds each row's sink, so the kernels' P = exp(S - LSE) and
    # dS = P (dP - delta) are the gradients of q, k and v as they are (a sink adds no value to O).
    dq = dk = dv = None
    if any(ctx.needs_input_grad[:3]):  # (learned sinks alone need none of the passes)
        dq, dk, dv = flash_attn_bwd(dout, q, k, v, out, lse, dlse, *ctx.options, slopes, seqused_k)
    return (dq, dk, dv) + (None,) * 11 + (_sink_gradient(sinks, dout, out, lse, dlse)
                                          if ctx.sinks and ctx.needs_input_grad[14] else None, None)


def _sink_gradient(sinks: torch.Tensor, dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of a call's loss in its sinks (fp32 [heads]): the sink of head h has the
    probability p = exp(sink_h - LSE) in each of its rows, and as a logit of no value its gradient
    is -sum over rows of p * (rowsum(dO * O) - dLSE), in fp32 from the saved output and LSE. Dense:
    dout and out [batch, heads, seq, head_dim], lse [batch, heads, seq]; packed (``cu_seqlens_q``):
    dout and out [total_q, heads, head_dim], lse [heads, total_q], whose rows past the last sequence
    (their LSE never written) count nothing."""
    delta = (dout.float() * out.float()).sum(-1)
    if cu_seqlens_q is not None:
        delta = delta.t()  # as the LSE: [heads, total_q]
    if dlse is not None:
        delta = delta - dlse.float()
    if cu_seqlens_q is None:
        p = torch.exp(sinks.detach().float()[None, :, None] - lse)
        return -(p * delta).sum((0, 2))
    live = torch.arange(lse.shape[1], device=lse.device) < cu_seqlens_q[-1]  # on the device: no synchronisation
    p = torch.exp(sinks.detach().float()[:, None] - lse)
    return -torch.where(live, p * delta, 0.0).sum(1)


flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)
