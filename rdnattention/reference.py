"""A float64 attention oracle written from scratch: the ground truth every kernel is checked against."""

from __future__ import annotations

import math

import torch


def to_odd_float(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x`` as float32 rounded to odd (truncated, the last bit set where that dropped
    anything): converted on to fp16 or bf16, it gives x's own rounding to nearest even, in one step
    on every device (float32 keeps 13 and 16 bits beyond theirs)."""
    f = x.float()
    away = torch.where(x > 0, f.double() > x, f.double() < x)  # rounded away from zero: one step back
    bits = f.view(torch.int32) - away.to(torch.int32)
    inexact = bits.view(torch.float32).double() != x
    return (bits | inexact.to(torch.int32)).view(torch.float32)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """RoPE on the first 2*cos.shape[1] features of x [..., seq, dim] at the given positions: [seq],
    or [batch, seq] for x [batch, heads, seq, dim] (each sequence at its own positions). Computed in
    float64, returned in x's dtype; for 16-bit x, rounded once to nearest even on every device
    (torch converts float64 to fp16 in one rounding on CUDA, through float32, twice, on the CPU), as
    the append kernels round."""
    half = cos.shape[1]
    c = cos[positions].to(torch.float64)
    s = sin[positions].to(torch.float64)
    if positions.dim() == 2:
        c, s = c[:, None], s[:, None]
    narrow = to_odd_float if x.element_size() <= 2 else (lambda t: t)
    out = x.clone()
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        out[..., 0:2 * half:2] = narrow(x1 * c - x2 * s)
        out[..., 1:2 * half:2] = narrow(x2 * c + x1 * s)
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]
        out[..., :half] = narrow(x1 * c - x2 * s)
        out[..., half:2 * half] = narrow(x2 * c + x1 * s)
    return out


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                        window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                        rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                        rotary_interleaved: bool = False, return_lse: bool = False,
                        seqused_k: torch.Tensor | None = None, softcap: float = 0.0,
                        alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """Attention in float64 on the CPU. Shapes [batch, heads, seq, head_dim]; K/V may have fewer heads.

    Query i sits at key position i + (Sk - Sq); RoPE rotates queries at those positions and keys at
    0..Sk-1. A row that sees no key is zero (and its log-sum-exp is -inf); a row with a NaN among
    the scores of the keys it sees is NaN, and so is its log-sum-exp (the scores of keys it does
    not see are masked out, NaN or not). ``seqused_k`` (int [batch]): batch b uses its first
    seqused_k[b] keys only, as if seq_k were that.

    Score transforms, in this order, on the scaled score s of query i and key j: ``softcap`` > 0
    makes it softcap * tanh(s / softcap); ``alibi_slopes`` ([heads_q] or [batch, heads_q]) add
    -slope * |i + Sk - Sq - j|; ``sinks`` ([heads_q]) add one logit per query head to each row's
    softmax (and its log-sum-exp) that weighs no value, so a row that sees no key is zero with the
    sink as its log-sum-exp."""
    if seqused_k is not None:  # each batch on its first seqused_k[b] keys, on its own
        def slopes(b):
            return alibi_slopes[b:b + 1] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        outs = [attention_reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], is_causal=is_causal,
                                    window_size=window_size, softmax_scale=softmax_scale, rotary_cos=rotary_cos,
                                    rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, return_lse=True,
                                    softcap=softcap, alibi_slopes=slopes(b), sinks=sinks)
                for b, n in enumerate(seqused_k.tolist())]
        out, lse = torch.cat([o for o, _ in outs]), torch.cat([x for _, x in outs])
        return (out, lse) if return_lse else out
    q64, k64, v64 = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    return _attention64(q64, k64, v64, is_causal=is_causal, window_size=window_size, softmax_scale=softmax_scale,
                        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                        return_lse=return_lse, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)


def attention_gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                        dlse: torch.Tensor | None = None, **options) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
    """The float64 gradients (dq, dk, dv) of attention_reference's output (with ``options``, its
    keywords but return_lse and seqused_k) against the output's gradient ``dout`` (and ``dlse``, the
    log-sum-exp's, where given), on the CPU: differentiated through the float64 computation, so K
    and V heads shared by a GQA group get the sum of the group's gradients."""
    if options.get("seqused_k") is not None or "return_lse" in options:
        raise ValueError("attention_gradients takes neither seqused_k nor return_lse")
    q64, k64, v64 = (t.detach().to("cpu", torch.float64).requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out, lse = _attention64(q64, k64, v64, return_lse=True, **options)
        loss = (out * dout.detach().to("cpu", torch.float64)).sum()
        if dlse is not None:
            seen = torch.isfinite(lse)  # a row that sees nothing has no gradient
            loss = loss + torch.where(seen, lse, 0.0).mul(dlse.detach().to("cpu", torch.float64)).sum()
        return torch.autograd.grad(loss, (q64, k64, v64))


def _attention64(q64: torch.Tensor, k64: torch.Tensor, v64: torch.Tensor, *, is_causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                 rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                 rotary_interleaved: bool = False, return_lse: bool = False, softcap: float = 0.0,
                 alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """attention_reference on float64 CPU tensors, differentiable in them."""
    batch, heads_q, seq_q, head_dim = q64.shape
    heads_kv, seq_k = k64.shape[1], k64.shape[2]
    if seq_k == 0:  # no key at all: every row is zero, its log-sum-exp -inf (or the sink's)
        out = torch.zeros(batch, heads_q, seq_q, head_dim, dtype=torch.float64)
        lse = torch.full((batch, heads_q, seq_q), -math.inf, dtype=torch.float64)
        if sinks is not None:
            lse[:] = sinks.to("cpu", torch.float64)[None, :, None]
        return (out, lse) if return_lse else out
    if rotary_cos is not None:
        cos, sin = rotary_cos.detach().cpu(), rotary_sin.detach().cpu()
        q64 = rotate(q64, cos, sin, torch.arange(seq_q) + (seq_k - seq_q), rotary_interleaved)
        k64 = rotate(k64, cos, sin, torch.arange(seq_k), rotary_interleaved)
    group = heads_q // heads_kv
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale

    scores = torch.einsum("bhqd,bhkd->bhqk", q64, k64) * scale
    diag = torch.arange(seq_q).unsqueeze(1) + (seq_k - seq_q)
    key = torch.arange(seq_k).unsqueeze(0)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slope = alibi_slopes.detach().to("cpu", torch.float64)
        slope = slope.expand(batch, heads_q)  # [heads_q] or [batch, heads_q]
        scores = scores - slope[:, :, None, None] * (diag - key).abs().to(torch.float64)
    left, right = window_size
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if left >= 0:
        visible &= key >= diag - left
    if right >= 0:
        visible &= key <= diag + right

    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:  # one more logit per row, of no value: the last column, dropped below
        sink = sinks.to("cpu", torch.float64)[None, :, None, None].expand(batch, heads_q, seq_q, 1)
        scores = torch.cat([scores, sink], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    # A row that sees no key is zero; a NaN among its visible scores makes it (and its LSE) NaN.
    weights = torch.where(total == 0, torch.zeros_like(weights), weights / torch.where(total == 0, 1.0, total))
    if sinks is not None:
        weights = weights[..., :seq_k]
    out = torch.einsum("bhqk,bhkd->bhqd", weights, v64)
    return (out, lse) if return_lse else out
