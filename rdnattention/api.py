"""The public entry points. Every argument is checked before anything is launched."""

from __future__ import annotations

import math

import torch

from . import dispatch, drivers
from .errors import InvalidArgumentError
from .families import f16
from .plan import Plan

_INT32_MAX = 2**31 - 1


def _check_tensor(name: str, t: object, rank: int = 4) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float16:
        raise InvalidArgumentError(f"{name} must be float16, got {t.dtype}")
    if t.dim() != rank:
        raise InvalidArgumentError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    # Kernels move rows in 16-byte pieces.
    if any(s % 8 for s in t.stride()[:3]) or t.data_ptr() % 16:
        raise InvalidArgumentError(
            f"{name} rows must start on 16-byte boundaries: strides {t.stride()[:3]} must be multiples of 8 "
            f"elements and the data pointer 16-byte aligned")
    return t


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


def _check_rotary(cos: object, sin: object, interleaved: object, q: torch.Tensor, seq_k: int) -> int:
    """Validates the RoPE tables; returns rotary_dim (0 when RoPE is off)."""
    if cos is None and sin is None:
        return 0
    if cos is None or sin is None:
        raise InvalidArgumentError("rotary_cos and rotary_sin must be given together")
    if not isinstance(interleaved, bool):
        raise InvalidArgumentError(f"rotary_interleaved must be a bool, got {interleaved!r}")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise InvalidArgumentError(f"{name} must be float32, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] == 0:
            raise InvalidArgumentError(f"{name} must be 2-D [positions, rotary_dim/2], got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}")
        if t.stride(1) != 1:
            raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise InvalidArgumentError(f"rotary_cos {tuple(cos.shape)} and rotary_sin {tuple(sin.shape)} "
                                   "must have the same shape and strides")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim > q.shape[3]:
        raise InvalidArgumentError(f"rotary_dim {rotary_dim} (2 * table width) exceeds head_dim {q.shape[3]}")
    if cos.shape[0] < seq_k:
        raise InvalidArgumentError(f"rotary tables have {cos.shape[0]} positions; keys need {seq_k} "
                                   "(positions 0..seq_k-1, queries at the last seq_q of them)")
    return rotary_dim


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
               window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
               rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
               rotary_interleaved: bool = False, return_lse: bool = False):
    """FlashAttention-2 forward on fp16 tensors [batch, heads, seq, head_dim]; returns a new tensor,
    or ``(out, lse)`` with ``return_lse=True`` (lse: float32 [batch, heads_q, seq_q], natural log).

    K and V may have fewer heads than Q (GQA/MQA: Q heads per K/V head must be a whole number) and a
    different sequence length (query i sits at key position i + Sk - Sq). ``is_causal`` hides keys after
    each query's position; ``window_size=(left, right)`` limits how far before/after it keys are seen
    (-1: unbounded). ``softmax_scale`` defaults to 1/sqrt(head_dim). ``rotary_cos``/``rotary_sin``
    (float32 [positions, rotary_dim/2], see :func:`rotary_tables`) apply RoPE to Q and K in the kernel."""
    plan = plan_flash_attn(q, k, v, is_causal=is_causal, window_size=window_size, softmax_scale=softmax_scale,
                           rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                           return_lse=return_lse)
    plan.run()
    out, lse = plan.outputs
    return (out, lse) if return_lse else out


def plan_flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                    rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                    rotary_interleaved: bool = False, return_lse: bool = False,
                    heavy_first: bool | None = None, kernel: str | None = None) -> Plan:
    """Validates a :func:`flash_attn` call and plans it without running it: the returned
    :class:`~rdnattention.plan.Plan` holds the outputs and launches; ``plan.run()`` executes it
    (again and again, for timing). ``heavy_first`` overrides the row-block order (default: longest
    first under causal-like masks); ``kernel`` forces a dispatch entry by name."""
    q, k, v = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("v", v)
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
    if len({q.device, k.device, v.device}) != 1:
        raise InvalidArgumentError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if max(seq_q, seq_k) > _INT32_MAX:
        raise InvalidArgumentError(f"sequence lengths must be below 2^31, got {seq_q} and {seq_k}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool) or not math.isfinite(softmax_scale):
        raise InvalidArgumentError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    if not isinstance(return_lse, bool):
        raise InvalidArgumentError(f"return_lse must be a bool, got {return_lse!r}")
    rotary_dim = _check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, seq_k)
    if heavy_first is not None and not isinstance(heavy_first, bool):
        raise InvalidArgumentError(f"heavy_first must be a bool or None, got {heavy_first!r}")
    if kernel is not None and not isinstance(kernel, str):
        raise InvalidArgumentError(f"kernel must be a kernel name (str) or None, got {kernel!r}")

    out = torch.empty((batch, heads_q, seq_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads_q, seq_q), dtype=torch.float32, device=q.device) if return_lse else None
    call = f16.Call(q=q, k=k, v=v, out=out, lse=lse, window=(left, right), softmax_scale=float(softmax_scale),
                    rotary_cos=rotary_cos if rotary_dim else None, rotary_sin=rotary_sin if rotary_dim else None,
                    rotary_interleaved=bool(rotary_interleaved) if rotary_dim else False)
    table = dispatch.table_for(drivers.target_of(q.device))
    plan = f16.plan(table, call, heavy_first=heavy_first, kernel=kernel)
    if out.numel() == 0 or seq_k == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        plan.launches.clear()
    return plan
