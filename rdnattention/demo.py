"""Run attention on the host emulator and check it against the float64 oracle.

    python -m rdnattention.demo
"""

from __future__ import annotations

import sys
import time

import torch

from . import attention_reference, flash_attn

TOLERANCE = 2e-3
CASES = [
    # batch, q heads, kv heads, q len, k len, head_dim, causal
    (1, 8, 4, 333, 333, 128, True),
    (2, 4, 4, 200, 200, 64, False),
    (1, 4, 1, 1, 500, 128, False),
]


def main() -> int:
    torch.manual_seed(0)
    worst = 0.0
    print(f"{'shape q / k':38} {'causal':>6} {'max abs err':>12} {'time':>8}")
    for b, hq, hk, sq, sk, d, causal in CASES:
        q = torch.randn(b, hq, sq, d).half()
        k = torch.randn(b, hk, sk, d).half()
        v = torch.randn(b, hk, sk, d).half()
        start = time.perf_counter()
        out = flash_attn(q, k, v, is_causal=causal)
        elapsed = time.perf_counter() - start
        err = (out.double() - attention_reference(q, k, v, is_causal=causal)).abs().max().item()
        worst = max(worst, err)
        shapes = f"{list(q.shape)} / {list(k.shape)}"
        print(f"{shapes:38} {str(causal):>6} {err:12.2e} {elapsed:7.2f}s")
    ok = worst <= TOLERANCE
    print(f"demo: host emulator vs float64 oracle, worst error {worst:.2e} "
          f"({'within' if ok else 'OVER'} the {TOLERANCE:g} tolerance)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
