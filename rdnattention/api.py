"""The public entry points. Every argument is checked before anything is launched."""

from __future__ import annotations

import math

import torch

from . import dispatch
from .abi import Fa2Args
from .drivers import host
from .errors import InvalidArgumentError, UnsupportedError

_LOG2E = 1.4426950408889634
_INT32_MAX = 2**31 - 1


def _target_of(device: torch.device) -> str:
    if device.type == "cpu":
        return "host"
    raise UnsupportedError(
        f"tensors on {device} are not served yet: this version runs the kernels on CPU tensors "
        "through the host emulator (target 'host'); GPU drivers are not part of it")


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


def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
               window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None) -> torch.Tensor:
    """FlashAttention-2 forward on fp16 tensors [batch, heads, seq, head_dim]; returns a new tensor.

    K and V may have fewer heads than Q (GQA/MQA: Q heads per K/V head must be a whole number) and a
    different sequence length (query i sits at key position i + Sk - Sq). ``is_causal`` hides keys after
    each query's position; ``window_size=(left, right)`` limits how far before/after it keys are seen
    (-1: unbounded). ``softmax_scale`` defaults to 1/sqrt(head_dim)."""
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

    table = dispatch.table_for(_target_of(q.device))
    entry = table.select("f16", head_dim, heads_q // heads_kv)
    out = torch.empty((batch, heads_q, seq_q, head_dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if seq_k == 0:
        return out.zero_()

    args = Fa2Args(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out.data_ptr(),
        batch=batch, heads_q=heads_q, heads_kv=heads_kv, seq_q=seq_q, seq_k=seq_k,
        window_left=left, window_right=right, scale_log2=float(softmax_scale) * _LOG2E)
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        for axis, stride in zip("bhs", t.stride()[:3]):
            setattr(args, f"{prefix}_stride_{axis}", stride)
    rows_per_head = entry.br // entry.gqa_group
    grid = (-(-seq_q // rows_per_head), heads_q // entry.gqa_group, batch)
    host.launch(table.code_object, entry.name, grid, entry.threads, args)
    return out
