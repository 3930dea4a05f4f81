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
