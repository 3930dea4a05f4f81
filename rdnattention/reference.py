"""A float64 attention oracle written from scratch: the ground truth every kernel is checked against."""

from __future__ import annotations

import math

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                        window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None) -> torch.Tensor:
    """Attention in float64 on the CPU. Shapes [batch, heads, seq, head_dim]; K/V may have fewer heads.

    Query i sits at key position i + (Sk - Sq). A row that sees no key is zero."""
    q64, k64, v64 = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    batch, heads_q, seq_q, head_dim = q64.shape
    heads_kv, seq_k = k64.shape[1], k64.shape[2]
    group = heads_q // heads_kv
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale

    scores = torch.einsum("bhqd,bhkd->bhqk", q64, k64) * scale
    diag = torch.arange(seq_q).unsqueeze(1) + (seq_k - seq_q)
    key = torch.arange(seq_k).unsqueeze(0)
    left, right = window_size
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if left >= 0:
        visible &= key >= diag - left
    if right >= 0:
        visible &= key <= diag + right

    scores = scores.masked_fill(~visible, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    weights = torch.where(total > 0, weights / total.clamp_min(1e-300), torch.zeros_like(weights))
    return torch.einsum("bhqk,bhkd->bhqd", weights, v64)
