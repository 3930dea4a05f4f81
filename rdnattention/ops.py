"""The forward pass as a torch custom op, `rdnattention::flash_attn_fwd`, with a fake
implementation: torch.compile traces calls into graphs without a break, and torch.library.opcheck
holds. Arguments are the kernel's: q, k, v as [batch, heads, seq, head_dim] views, the window after
folding causal in, the softmax scale, RoPE tables or None, whether to return the log-sum-exp, and
whether the output is stored token-major ([batch, seq, heads, head_dim], returned as the
[batch, heads, seq, head_dim] view of it). The entry points in api.py validate before calling it.
`rdnattention::flash_attn_int8qk_fwd` is the INT8 family's (int8.py), the same way."""

from __future__ import annotations

from typing import Optional

import torch

from . import api


@torch.library.custom_op("rdnattention::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary_cos: Optional[torch.Tensor],
                   rotary_sin: Optional[torch.Tensor], window_left: int, window_right: int, softmax_scale: float,
                   rotary_interleaved: bool, return_lse: bool, token_major: bool,
                   seqused_k: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    o = api.Options(window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
                    rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                    return_lse=return_lse, seqused_k=seqused_k)
    plan = api._plan(q, k, v, o, token_major)
    plan.run()
    return plan.outputs


@flash_attn_fwd.register_fake
def _(q, k, v, rotary_cos, rotary_sin, window_left, window_right, softmax_scale, rotary_interleaved, return_lse,
      token_major, seqused_k=None):
    return api._allocate(q, token_major, return_lse)


@torch.library.custom_op("rdnattention::flash_attn_int8qk_fwd", mutates_args=())
def flash_attn_int8qk_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor,
                          k_scale: torch.Tensor, v_scale: torch.Tensor, window_left: int, window_right: int,
                          softmax_scale: float, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from . import int8
    o = api.Options(window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
                    rotary_cos=None, rotary_sin=None, rotary_interleaved=False, return_lse=return_lse)
    plan = int8._plan(q, k, v, q_scale, k_scale, v_scale, o)
    plan.run()
    return plan.outputs


@flash_attn_int8qk_fwd.register_fake
def _(q, k, v, q_scale, k_scale, v_scale, window_left, window_right, softmax_scale, return_lse):
    from . import int8
    return int8._allocate(q, return_lse)
