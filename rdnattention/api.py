"""The public entry points. Every argument is checked before anything is launched.

Three layouts of one forward pass: `flash_attn` on [batch, heads, seq, head_dim] (the native
layout), `flash_attn_func` on flash-attn's token-major [batch, seq, heads, head_dim], and
`scaled_dot_product_attention` with torch's signature and semantics. All three run the
`rdnattention::flash_attn_fwd` custom op (ops.py): called directly in eager mode, through the
dispatcher under torch.compile or on tensor subclasses, so compiled graphs need no break."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from . import dispatch, drivers
from .errors import InvalidArgumentError, KernelsNotBuiltError, RdnaAttentionError, UnsupportedError
from .families import f16
from .plan import Plan

_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38
_LOG2E = 1.4426950408889634
_CACHE_LIMIT = 1024
_NATIVE = "[batch, heads, seq, head_dim]"
_TOKEN_MAJOR = "[batch, seq, heads, head_dim]"
_warned_layout = False


@dataclass(frozen=True)
class Options:
    """A validated call's options, in the kernel's terms."""

    window_left: int
    window_right: int
    softmax_scale: float
    rotary_cos: torch.Tensor | None
    rotary_sin: torch.Tensor | None
    rotary_interleaved: bool
    return_lse: bool
    seqused_k: torch.Tensor | None = None  # int32 [batch]: keys each batch uses (a preallocated cache)


def _check_tensor(name: str, t: object, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float16:
        raise InvalidArgumentError(f"{name} must be float16, got {t.dtype}")
    if t.dim() != 4:
        raise InvalidArgumentError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
    return t


def _check_rows(name: str, t: torch.Tensor) -> None:
    """The kernel's view [batch, heads, seq, head_dim]: contiguous rows on 16-byte multiples."""
    stride = t.stride()
    per16 = 16 // t.element_size()
    if stride[3] != 1 and t.shape[3] > 1:
        raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {stride}")
    if stride[0] % per16 or stride[1] % per16 or stride[2] % per16:
        raise InvalidArgumentError(
            f"{name} rows must start on 16-byte boundaries: strides {stride[:3]} must be multiples of {per16} "
            f"elements and the data pointer 16-byte aligned")


def _check_window(window_size: object) -> tuple[int, int]:
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise InvalidArgumentError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise InvalidArgumentError(f"window_size values must be >= -1 (-1: unbounded), got {tuple(window_size)}")
    return left, right


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


def _check_rotary(cos: object, sin: object, interleaved: object, q: torch.Tensor, seq_k: int) -> bool:
    """Validates the RoPE tables (float32 or q's dtype); returns whether RoPE is on."""
    if cos is None and sin is None:
        return False
    if cos is None or sin is None:
        raise InvalidArgumentError("rotary_cos and rotary_sin must be given together")
    if not isinstance(interleaved, bool):
        raise InvalidArgumentError(f"rotary_interleaved must be a bool, got {interleaved!r}")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, q.dtype):
            raise InvalidArgumentError(f"{name} must be float32 or q's dtype ({q.dtype}), got {t.dtype}")
        if t.dim() != 2 or t.shape[1] == 0:
            raise InvalidArgumentError(f"{name} must be 2-D [positions, rotary_dim/2], got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}")
        if t.stride(1) != 1:
            raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.dtype != sin.dtype:
        raise InvalidArgumentError(f"rotary_cos {tuple(cos.shape)} {cos.dtype} and rotary_sin {tuple(sin.shape)} "
                                   f"{sin.dtype} must have the same shape, strides and dtype")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim > q.shape[3]:
        raise InvalidArgumentError(f"rotary_dim {rotary_dim} (2 * table width) exceeds head_dim {q.shape[3]}")
    if q.shape[2] > seq_k:
        raise InvalidArgumentError(f"with RoPE, seq_q ({q.shape[2]}) must not exceed seq_k ({seq_k}): query i sits at "
                                   "position i + seq_k - seq_q, which must be a row of the tables")
    if cos.shape[0] < seq_k:
        raise InvalidArgumentError(f"rotary tables have {cos.shape[0]} positions; keys need {seq_k} "
                                   "(positions 0..seq_k-1, queries at the last seq_q of them)")
    return True


def _check_seqused(seqused_k: object, q: torch.Tensor) -> torch.Tensor | None:
    """Cache lengths: int32 [batch] on q's device (their values are checked when planned)."""
    if seqused_k is None:
        return None
    if not isinstance(seqused_k, torch.Tensor):
        raise InvalidArgumentError(f"seqused_k must be a torch.Tensor or None, got {type(seqused_k).__name__}")
    if seqused_k.dtype != torch.int32 or tuple(seqused_k.shape) != (q.shape[0],):
        raise InvalidArgumentError(f"seqused_k must be int32 [batch] = ({q.shape[0]},), got {seqused_k.dtype} "
                                   f"{tuple(seqused_k.shape)}")
    if seqused_k.device != q.device:
        raise InvalidArgumentError(f"seqused_k is on {seqused_k.device}, q on {q.device}")
    if seqused_k.numel() > 1 and seqused_k.stride(0) != 1:
        raise InvalidArgumentError(f"seqused_k must be contiguous, got stride {seqused_k.stride()}")
    return seqused_k


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: object, window_size: object,
              softmax_scale: object, rotary_cos: object, rotary_sin: object, rotary_interleaved: object,
              return_lse: object, seqused_k: object = None) -> Options:
    """Everything but the data pointers, so it runs on fake tensors too. q, k, v: the kernel's view."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rows(name, t)
    if not isinstance(is_causal, bool):
        raise InvalidArgumentError(f"is_causal must be a bool, got {is_causal!r}")
    left, right = _check_window(window_size)
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    batch, heads_q, seq_q, head_dim = q.shape
    _, heads_kv, seq_k, _ = k.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise InvalidArgumentError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} "
                                   "in batch or head_dim")
    if v.shape != k.shape:
        raise InvalidArgumentError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise InvalidArgumentError(f"q heads ({heads_q}) must be a multiple of k/v heads ({heads_kv})")
    if q.device != k.device or q.device != v.device:
        raise InvalidArgumentError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if max(seq_q, seq_k) > _INT32_MAX:
        raise InvalidArgumentError(f"sequence lengths must be below 2^31, got {seq_q} and {seq_k}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool) or not math.isfinite(softmax_scale):
        raise InvalidArgumentError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    if abs(float(softmax_scale)) * _LOG2E > _FLOAT32_MAX:
        raise InvalidArgumentError(f"softmax_scale {softmax_scale!r} times log2(e) is beyond float32's range; "
                                   "the kernel scales scores in float32")
    # Windows at least as long as the sequences change nothing: clamp them so any int packs into
    # the kernel's 32-bit fields (INT_MAX or 2**40 for "unbounded" behave like -1).
    if left >= seq_k:
        left = -1
    if right >= seq_q:
        right = seq_q
    if not isinstance(return_lse, bool):
        raise InvalidArgumentError(f"return_lse must be a bool, got {return_lse!r}")
    rope = _check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, seq_k)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise UnsupportedError("rdnattention is forward-only and q, k or v requires grad: run it under "
                               "torch.no_grad() or torch.inference_mode(), or pass detached tensors")
    return Options(window_left=left, window_right=right, softmax_scale=float(softmax_scale),
                   rotary_cos=rotary_cos if rope else None, rotary_sin=rotary_sin if rope else None,
                   rotary_interleaved=bool(rotary_interleaved) if rope else False, return_lse=return_lse,
                   seqused_k=_check_seqused(seqused_k, q))


def _allocate(q: torch.Tensor, token_major: bool, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The output in the caller's layout, as the kernel's [batch, heads, seq, head_dim] view, and the
    log-sum-exp (an empty tensor when not asked for)."""
    batch, heads, seq, dim = q.shape
    if token_major:
        out = torch.empty((batch, seq, heads, dim), dtype=q.dtype, device=q.device).transpose(1, 2)
    else:
        out = torch.empty((batch, heads, seq, dim), dtype=q.dtype, device=q.device)
    lse_shape = (batch, heads, seq) if return_lse else (0,)
    return out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)


def _table(device: torch.device) -> dispatch.TargetTable:
    driver = drivers.for_device(device)
    target = drivers.target_of(device, driver)
    try:
        table = dispatch.table_for(target)
    except KernelsNotBuiltError:
        if device.type != "cuda":
            raise
        table = dispatch.table_for(target, torch.cuda.get_device_name(device))
    if table.platform != driver.PLATFORM:  # a forced target of another platform: its kernels cannot read these tensors
        env = drivers.env_naming_target(device)
        chosen = f"{env}={target}" if env else f"target {target}"
        raise UnsupportedError(f"{chosen} names a target of platform {table.platform}, but tensors on {device} "
                               f"run on {driver.PLATFORM} targets; unset {env or 'it'} or name a {driver.PLATFORM} "
                               "target")
    return table


def can_read(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values: not while torch.compile traces (a data-dependent
    branch breaks the graph) nor while a CUDA graph is captured (a device read is not allowed).
    Those calls rely on their eager run having been checked; the kernels clamp lengths."""
    return not (torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def _check_memory(name: str, t: torch.Tensor) -> None:
    """The tensor has memory the kernel can read: a real pointer, a storage covering every element
    its shape and strides reach, no lazy negation or conjugation."""
    if t.is_neg() or t.is_conj():
        raise InvalidArgumentError(f"{name} is a lazily negated or conjugated view; pass {name}.resolve_neg() "
                                   "(or .resolve_conj())")
    if t.numel() == 0:
        return
    if t.data_ptr() == 0:
        raise InvalidArgumentError(f"{name} has no memory behind it (null data pointer: a freed or resized-away "
                                   "storage, or a meta tensor)")
    extent = t.storage_offset() * t.element_size() + _reach(t)
    if extent > t.untyped_storage().nbytes():
        raise InvalidArgumentError(f"{name}'s shape {tuple(t.shape)} and strides {t.stride()} reach {extent} bytes "
                                   f"but its storage holds {t.untyped_storage().nbytes()}")


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: Options, token_major: bool,
          heavy_first: bool | None = None, kernel: str | None = None) -> Plan:
    for name, t in (("q", q), ("k", k), ("v", v), ("rotary_cos", o.rotary_cos), ("rotary_sin", o.rotary_sin)):
        if t is None:
            continue
        _check_memory(name, t)
        if name in "qkv" and t.data_ptr() % 16:
            raise InvalidArgumentError(
                f"{name} rows must start on 16-byte boundaries: strides {t.stride()[:3]} must be multiples of 8 "
                f"elements and the data pointer 16-byte aligned")
    cos, sin = o.rotary_cos, o.rotary_sin
    if cos is not None and cos.dtype != torch.float32:  # q's dtype: the kernel reads fp32 tables
        cos, sin = cos.float(), sin.float()
    out, lse = _allocate(q, token_major, o.return_lse)
    if o.seqused_k is not None:
        _check_memory("seqused_k", o.seqused_k)
        if (o.seqused_k.numel() and can_read(o.seqused_k)
                and not bool(((o.seqused_k >= 0) & (o.seqused_k <= k.shape[2])).all())):
            raise InvalidArgumentError(f"seqused_k values must lie in [0, seq_k = {k.shape[2]}], got "
                                       f"{o.seqused_k.tolist()}")
    call = f16.Call(q=q, k=k, v=v, out=out, lse=lse if o.return_lse else None, seqused_k=o.seqused_k,
                    window=(o.window_left, o.window_right), softmax_scale=o.softmax_scale,
                    rotary_cos=cos, rotary_sin=sin, rotary_interleaved=o.rotary_interleaved)
    return _with_outputs(f16.plan(_table(q.device), call, heavy_first=heavy_first, kernel=kernel), out, lse, k)


def _with_outputs(plan: Plan, out: torch.Tensor, lse: torch.Tensor, k: torch.Tensor) -> Plan:
    """The plan returning (out, lse); with no output or no key it launches nothing: zero rows, LSE -inf."""
    plan.outputs = (out, lse)
    if out.numel() == 0 or k.shape[2] == 0:
        out.zero_()
        lse.fill_(-math.inf)
        plan.launches.clear()
    return plan


@dataclass(frozen=True)
class _Replay:
    """A planned single launch kept for calls of the same geometry: everything but the pointers."""

    table: dispatch.TargetTable  # kept alive, so the id() in the key is never reused
    driver: object
    name: str
    grid: tuple[int, int, int]
    block: int
    shared_bytes: int
    args: object  # the argument struct; each call copies it and sets the pointers
    reach: tuple[int, int, int]  # bytes q, k, v span from their first element (shape and strides)


# Calls already validated and planned, by everything validation and planning read: the table, the
# shapes, strides, dtypes and devices of q, k, v, and the options (with their types, so that
# True and 1 stay different keys). A hit skips both; the data pointers are checked every call.
_replays: dict[tuple, _Replay] = {}


def _key(q, k, v, is_causal, window_size, softmax_scale, return_lse, token_major) -> tuple | None:
    if (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor
            or type(is_causal) is not bool or type(return_lse) is not bool or type(window_size) is not tuple
            or len(window_size) != 2 or type(window_size[0]) is not int or type(window_size[1]) is not int
            or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            or torch.compiler.is_compiling() or torch.jit.is_tracing()):
        return None
    device = q.device
    try:
        table = _table(device)
    except RdnaAttentionError:
        return None  # the full path raises it
    return (id(table), q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
            device, k.device, v.device, is_causal, window_size, type(softmax_scale), softmax_scale, return_lse,
            token_major)


def _replay(key: tuple, q, k, v, return_lse: bool, token_major: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    r = _replays.get(key)
    if r is None:
        return None
    qp, kp, vp = q.data_ptr(), k.data_ptr(), v.data_ptr()
    rq, rk, rv = r.reach
    if ((qp | kp | vp) & 15 or not (qp and kp and vp) or q.is_neg() or k.is_neg() or v.is_neg()
            or 2 * q.storage_offset() + rq > q.untyped_storage().nbytes()
            or 2 * k.storage_offset() + rk > k.untyped_storage().nbytes()
            or 2 * v.storage_offset() + rv > v.untyped_storage().nbytes()):
        return None  # the full path raises the error
    batch, heads, seq, dim = q.shape
    if token_major:
        out = torch.empty((batch, seq, heads, dim), dtype=q.dtype, device=q.device).transpose(1, 2)
    else:
        out = torch.empty((batch, heads, seq, dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seq), dtype=torch.float32, device=q.device) if return_lse else None
    args = type(r.args).from_buffer_copy(r.args)
    args.q, args.k, args.v, args.o = qp, kp, vp, out.data_ptr()
    if lse is not None:
        args.lse = lse.data_ptr()
    r.driver.launch_kernel(r.table.code_object, r.name, r.grid, r.block, args, q.device, r.shared_bytes)
    return out, lse


def _reach(t: torch.Tensor) -> int:
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def _remember(key: tuple, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if len(plan.launches) != 1 or q.element_size() != 2:
        return
    if len(_replays) >= _CACHE_LIMIT:
        _replays.clear()
    launch = plan.launches[0]
    _replays[key] = _Replay(table=plan.table, driver=drivers.for_platform(plan.table.platform),
                            name=launch.kernel.name, grid=launch.grid, block=launch.block,
                            shared_bytes=launch.shared_bytes, args=launch.args, reach=(_reach(q), _reach(k), _reach(v)))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: Options, token_major: bool,
            key: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs a validated call: directly in eager mode, through the custom op where torch traces.
    With ``key`` (see _key), the plan is kept for later calls of the same geometry."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or not (type(q) is type(k) is type(v) is torch.Tensor)):
        from . import ops
        return ops.flash_attn_fwd(q, k, v, o.rotary_cos, o.rotary_sin, o.window_left, o.window_right,
                                  o.softmax_scale, o.rotary_interleaved, o.return_lse, token_major, o.seqused_k)
    plan = _plan(q, k, v, o, token_major)
    plan.run()
    if key is not None and o.rotary_cos is None:
        _remember(key, plan, q, k, v)
    return plan.outputs


def _warn_if_token_major(q: torch.Tensor) -> None:
    global _warned_layout
    _, heads, seq, _ = q.shape
    if not _warned_layout and heads > 512 and seq < heads and not torch.compiler.is_compiling():
        _warned_layout = True
        warnings.warn(f"flash_attn takes {_NATIVE}; q has shape {tuple(q.shape)}, {heads} heads for {seq} positions, "
                      f"which looks like {_TOKEN_MAJOR}: use rdnattention.flash_attn_func for that layout",
                      stacklevel=3)


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
               window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
               rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
               rotary_interleaved: bool = False, return_lse: bool = False, seqused_k: torch.Tensor | None = None):
    """FlashAttention-2 forward on fp16 tensors [batch, heads, seq, head_dim]; returns a new tensor,
    or ``(out, lse)`` with ``return_lse=True`` (lse: float32 [batch, heads_q, seq_q], natural log).

    K and V may have fewer heads than Q (GQA/MQA: Q heads per K/V head must be a whole number) and a
    different sequence length (query i sits at key position i + Sk - Sq). ``is_causal`` hides keys after
    each query's position; ``window_size=(left, right)`` limits how far before/after it keys are seen
    (-1: unbounded). ``softmax_scale`` defaults to 1/sqrt(head_dim). ``rotary_cos``/``rotary_sin``
    ([positions, rotary_dim/2], float32 or q's dtype; see :func:`rotary_tables`) apply RoPE to Q and K
    in the kernel. ``seqused_k`` (int32 [batch]) gives the keys each batch uses, the first
    seqused_k[b] of a preallocated cache of seq_k rows; queries align to the end of those."""
    key = None
    if rotary_cos is None and rotary_sin is None and seqused_k is None:
        key = _key(q, k, v, is_causal, window_size, softmax_scale, return_lse, False)
        hit = _replay(key, q, k, v, return_lse, False) if key is not None else None
        if hit is not None:
            return hit if return_lse else hit[0]
    q, k, v = (_check_tensor(n, t, _NATIVE) for n, t in (("q", q), ("k", k), ("v", v)))
    o = _validate(q, k, v, is_causal=is_causal, window_size=window_size, softmax_scale=softmax_scale,
                  rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                  return_lse=return_lse, seqused_k=seqused_k)
    _warn_if_token_major(q)
    out, lse = forward(q, k, v, o, token_major=False, key=key)
    return (out, lse) if return_lse else out


def plan_flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                    rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                    rotary_interleaved: bool = False, return_lse: bool = False,
                    seqused_k: torch.Tensor | None = None,
                    heavy_first: bool | None = None, kernel: str | None = None) -> Plan:
    """Validates a :func:`flash_attn` call and plans it without running it: the returned
    :class:`~rdnattention.plan.Plan` holds the outputs and launches; ``plan.run()`` executes it
    (again and again, for timing). ``heavy_first`` overrides the row-block order (default: longest
    first under causal-like masks); ``kernel`` forces a dispatch entry by name."""
    q, k, v = (_check_tensor(n, t, _NATIVE) for n, t in (("q", q), ("k", k), ("v", v)))
    o = _validate(q, k, v, is_causal=is_causal, window_size=window_size, softmax_scale=softmax_scale,
                  rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                  return_lse=return_lse, seqused_k=seqused_k)
    if heavy_first is not None and not isinstance(heavy_first, bool):
        raise InvalidArgumentError(f"heavy_first must be a bool or None, got {heavy_first!r}")
    if kernel is not None and not isinstance(kernel, str):
        raise InvalidArgumentError(f"kernel must be a kernel name (str) or None, got {kernel!r}")
    return _plan(q, k, v, o, token_major=False, heavy_first=heavy_first, kernel=kernel)


def refuse_missing_features(dropout_p: object, softcap: object, alibi_slopes: object) -> None:
    """flash-attn's options this library does not have: UnsupportedError naming each."""
    if dropout_p != 0.0:
        raise UnsupportedError(f"dropout_p={dropout_p!r}: rdnattention has no dropout (inference only); pass 0.0")
    if softcap != 0.0:
        raise UnsupportedError(f"softcap={softcap!r}: logit softcapping is not implemented; pass 0.0")
    if alibi_slopes is not None:
        raise UnsupportedError("alibi_slopes: ALiBi is not implemented; pass None")


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                    deterministic: bool = False, return_attn_probs: bool = False, *,
                    rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                    rotary_interleaved: bool = False):
    """flash-attn's ``flash_attn_func``: fp16 q [batch, seq_q, heads, head_dim], k and v
    [batch, seq_k, heads_kv, head_dim]; returns out [batch, seq_q, heads, head_dim], or
    ``(out, softmax_lse, None)`` with ``return_attn_probs=True`` (lse float32 [batch, heads, seq_q];
    the attention probabilities themselves are not materialised). Causal masks align to the end of
    the keys, as flash-attn's do. dropout, softcap and ALiBi raise UnsupportedError; the kernels are
    deterministic, so ``deterministic`` needs nothing. RoPE options as in :func:`flash_attn`."""
    refuse_missing_features(dropout_p, softcap, alibi_slopes)
    if not isinstance(deterministic, bool) or not isinstance(return_attn_probs, bool):
        raise InvalidArgumentError(f"deterministic and return_attn_probs must be bools, got {deterministic!r} "
                                   f"and {return_attn_probs!r}")
    q, k, v = (_check_tensor(n, t, _TOKEN_MAJOR).transpose(1, 2) for n, t in (("q", q), ("k", k), ("v", v)))
    key = None
    hit = None
    if rotary_cos is None and rotary_sin is None:
        key = _key(q, k, v, causal, window_size, softmax_scale, return_attn_probs, True)
        hit = _replay(key, q, k, v, return_attn_probs, True) if key is not None else None
    if hit is not None:
        out, lse = hit
    else:
        o = _validate(q, k, v, is_causal=causal, window_size=window_size, softmax_scale=softmax_scale,
                      rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                      return_lse=return_attn_probs)
        out, lse = forward(q, k, v, o, token_major=True, key=key)
    out = out.transpose(1, 2)
    return (out, lse, None) if return_attn_probs else out


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
        raise UnsupportedError(f"dropout_p={dropout_p!r}: rdnattention has no dropout (inference only); pass 0.0")
    if not isinstance(enable_gqa, bool) or not isinstance(is_causal, bool):
        raise InvalidArgumentError(f"is_causal and enable_gqa must be bools, got {is_causal!r} and {enable_gqa!r}")
    q, k, v = (_check_tensor(n, t, _NATIVE) for n, t in (("query", query), ("key", key), ("value", value)))
    if not enable_gqa and q.shape[1] != k.shape[1]:
        raise InvalidArgumentError(f"query has {q.shape[1]} heads and key {k.shape[1]}: pass enable_gqa=True for "
                                   "grouped-query attention")
    seq_q, seq_k = q.shape[2], k.shape[2]
    window = (-1, -1)
    if is_causal and seq_k > seq_q:
        # Top-left: no query sees a key at or past seq_q, and on the first seq_q keys the
        # kernel's end-aligned diagonal is the top-left one.
        k, v = k[:, :, :seq_q], v[:, :, :seq_q]
        window = (-1, 0)
    elif is_causal:
        window = (-1, seq_q - seq_k)  # query i, end-aligned at i - (seq_q - seq_k), sees keys up to i
    o = _validate(q, k, v, is_causal=False, window_size=window, softmax_scale=scale, rotary_cos=None,
                  rotary_sin=None, rotary_interleaved=False, return_lse=False)
    return forward(q, k, v, o, token_major=False)[0]
