"""The float64 oracle itself, against plain Python loops on tiny inputs."""

import math

import pytest
import torch

from rdnattention import attention_reference


def _loops(q, k, v, causal, window, scale):
    batch, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    out = torch.zeros(batch, hq, sq, d, dtype=torch.float64)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    for b in range(batch):
        for h in range(hq):
            kh = h // (hq // hk)
            for i in range(sq):
                diag = i + sk - sq
                keys = [j for j in range(sk) if (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)]
                if not keys:
                    continue
                s = [scale * sum(float(q[b, h, i, x]) * float(k[b, kh, j, x]) for x in range(d)) for j in keys]
                mx = max(s)
                w = [math.exp(x - mx) for x in s]
                total = sum(w)
                for x in range(d):
                    out[b, h, i, x] = sum(wj * float(v[b, kh, j, x]) for wj, j in zip(w, keys)) / total
    return out


@pytest.mark.parametrize("hq, hk, sq, sk, causal, window", [
    (2, 2, 5, 5, False, (-1, -1)),
    (4, 2, 6, 6, True, (-1, -1)),
    (2, 1, 3, 7, True, (-1, -1)),
    (2, 2, 6, 6, False, (2, 1)),
    (2, 2, 6, 4, True, (0, -1)),  # early rows see no key
])
def test_oracle_matches_loops(hq, hk, sq, sk, causal, window):
    g = torch.Generator().manual_seed(sq * 31 + sk)
    q = torch.randn(1, hq, sq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, hk, sk, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, hk, sk, 8, generator=g, dtype=torch.float64)
    got = attention_reference(q, k, v, is_causal=causal, window_size=window, softmax_scale=0.4)
    torch.testing.assert_close(got, _loops(q, k, v, causal, window, 0.4), rtol=1e-12, atol=1e-12)


def _loops_transformed(q, k, v, causal, window, scale, softcap, slopes, sinks):
    """The score transforms written out: softcap * tanh(s / softcap), then -slope * |i + sk - sq - j|,
    and a sink logit per head in the denominator (and the log-sum-exp) with no value."""
    batch, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    out = torch.zeros(batch, hq, sq, d, dtype=torch.float64)
    lse = torch.full((batch, hq, sq), -math.inf, dtype=torch.float64)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    for b in range(batch):
        for h in range(hq):
            kh = h // (hq // hk)
            slope = 0.0 if slopes is None else float(slopes[b, h] if slopes.dim() == 2 else slopes[h])
            for i in range(sq):
                diag = i + sk - sq
                keys = [j for j in range(sk) if (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)]
                s = []
                for j in keys:
                    x = scale * sum(float(q[b, h, i, c]) * float(k[b, kh, j, c]) for c in range(d))
                    if softcap:
                        x = softcap * math.tanh(x / softcap)
                    s.append(x - slope * abs(diag - j))
                logits = s + ([float(sinks[h])] if sinks is not None else [])
                if not logits:
                    continue
                mx = max(logits)
                total = sum(math.exp(x - mx) for x in logits)
                lse[b, h, i] = mx + math.log(total)
                for c in range(d):
                    out[b, h, i, c] = sum(math.exp(x - mx) * float(v[b, kh, j, c]) for x, j in zip(s, keys)) / total
    return out, lse


@pytest.mark.parametrize("hq, hk, sq, sk, causal, window, softcap, alibi, sinks", [
    (2, 2, 5, 5, False, (-1, -1), 1.5, None, False),
    (4, 2, 6, 6, True, (-1, -1), 0.0, "heads", False),
    (2, 1, 3, 7, True, (-1, -1), 0.0, "batch", False),
    (2, 2, 6, 6, False, (2, 1), 0.0, None, True),
    (2, 2, 6, 4, True, (0, -1), 2.0, "batch", True),  # early rows see no key: zero, the sink's LSE
])
def test_oracle_transforms_match_loops(hq, hk, sq, sk, causal, window, softcap, alibi, sinks):
    g = torch.Generator().manual_seed(sq * 37 + sk)
    q = torch.randn(2, hq, sq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, hk, sk, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, hk, sk, 8, generator=g, dtype=torch.float64)
    slopes = None if alibi is None else torch.rand(hq if alibi == "heads" else (2, hq), generator=g)
    sink = torch.randn(hq, generator=g) if sinks else None
    got, got_lse = attention_reference(q, k, v, is_causal=causal, window_size=window, softmax_scale=0.4,
                                       softcap=softcap, alibi_slopes=slopes, sinks=sink, return_lse=True)
    want, want_lse = _loops_transformed(q, k, v, causal, window, 0.4, softcap, slopes, sink)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)


def test_oracle_transforms_with_cache_lengths_slice_per_batch():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 3, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    slopes, sinks = torch.rand(2, 2, generator=g), torch.randn(2, generator=g)
    got = attention_reference(q, k, v, is_causal=True, seqused_k=torch.tensor([9, 4]), alibi_slopes=slopes,
                              sinks=sinks, softcap=1.0)
    for b, n in enumerate((9, 4)):
        want, _ = _loops_transformed(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], True, (-1, -1),
                                     1 / math.sqrt(8), 1.0, slopes[b:b + 1], sinks)
        torch.testing.assert_close(got[b:b + 1], want, rtol=1e-12, atol=1e-12)
