"""The fp16 forward on [batch, heads, seq, head_dim] views, as the entry points in api.py (and
flash_attn_with_kvcache's plain caches) run it once they have validated a call (options.py):
planned here, the kernel chosen by route.py, and run directly in eager mode or through the custom
op ``rdnattention::flash_attn_fwd`` where torch traces or the tensors are subclasses, so compiled
graphs need no break. The op has a fake implementation and torch.library.opcheck holds. Its
arguments are the kernel's: q, k, v as [batch, heads, seq, head_dim] views, the window after
folding causal in, the softmax scale, RoPE tables or None, whether to return the log-sum-exp,
whether the output is stored token-major ([batch, seq, heads, head_dim], returned as the
[batch, heads, seq, head_dim] view of it), and per-sequence key counts or None."""

from __future__ import annotations

from typing import Optional

import torch

from . import checks, replay, route
from .errors import InvalidArgumentError
from .options import Options
from .plan import Plan


def allocate(q: torch.Tensor, token_major: bool, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The output in the caller's layout, as the kernel's [batch, heads, seq, head_dim] view, and the
    log-sum-exp (an empty tensor when not asked for)."""
    batch, heads, seq, dim = q.shape
    if token_major:
        out = torch.empty((batch, seq, heads, dim), dtype=q.dtype, device=q.device).transpose(1, 2)
    else:
        out = torch.empty((batch, heads, seq, dim), dtype=q.dtype, device=q.device)
    lse_shape = (batch, heads, seq) if return_lse else (0,)
    return out, torch.empty(lse_shape, dtype=torch.float32, device=q.device)


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
        if not values_checked:
            checks.Values().within("seqused_k", o.seqused_k, 0, k.shape[2], "seq_k").check()
    out, lse = allocate(q, token_major, o.return_lse)
    call = route.Attention(q=q, k=k, v=v, out=out, lse=lse if o.return_lse else None,
                           window=(o.window_left, o.window_right), softmax_scale=o.softmax_scale,
                           batch=q.shape[0], seq_q=q.shape[2], seq_k=k.shape[2], seqused_k=o.seqused_k,
                           rotary_cos=cos, rotary_sin=sin, rotary_interleaved=o.rotary_interleaved,
                           heavy_first=heavy_first, kernel=kernel)
    empty = out.numel() == 0 or k.shape[2] == 0
    return route.plan(route.device_table(q.device), call).returning(out, lse, empty=empty)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: Options, token_major: bool,
            key: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs a validated call: directly in eager mode, through the custom op where torch traces.
    With ``key`` (replay.key), the plan is kept for later calls of the same geometry."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or not (type(q) is type(k) is type(v) is torch.Tensor)):
        return flash_attn_fwd(q, k, v, o.rotary_cos, o.rotary_sin, o.window_left, o.window_right, o.softmax_scale,
                              o.rotary_interleaved, o.return_lse, token_major, o.seqused_k)
    p = plan(q, k, v, o, token_major)
    p.run()
    if key is not None and o.rotary_cos is None:
        replay.remember(key, p, q, k, v)
    return p.outputs


@torch.library.custom_op("rdnattention::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary_cos: Optional[torch.Tensor],
                   rotary_sin: Optional[torch.Tensor], window_left: int, window_right: int, softmax_scale: float,
                   rotary_interleaved: bool, return_lse: bool, token_major: bool,
                   seqused_k: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    o = Options(window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
                rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                return_lse=return_lse, seqused_k=seqused_k)
    p = plan(q, k, v, o, token_major)
    p.run()
    return p.outputs


@flash_attn_fwd.register_fake
def _(q, k, v, rotary_cos, rotary_sin, window_left, window_right, softmax_scale, rotary_interleaved, return_lse,
      token_major, seqused_k=None):
    return allocate(q, token_major, return_lse)
