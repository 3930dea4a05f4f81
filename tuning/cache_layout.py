"""The split-KV decode over flash_attn_with_kvcache's token-major cache ([batch, positions, heads_kv,
head_dim]) against the same keys head-major ([batch, heads_kv, positions, head_dim], flash_attn's
layout; passed to flash_attn_with_kvcache as a transposed view) and torch's SDPA on those, per slice
count: GPU time per call of back-to-back calls
(timing.stream_ms), the plans timed in turn.

    python -m tuning.cache_layout --batch 8 --keys 8192 --splits 0,1,2,4,8,16

0 is the automatic slice count (_splitkv.splits_for). GB/s counts the K and V bytes read."""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from .timing import stream_ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--keys", type=int, default=8192)
    p.add_argument("--heads", default="32/8", help="query heads / K/V heads (default 32/8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--splits", default="0,1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 1
    import rdnattention

    hq, hk = (int(x) for x in args.heads.split("/"))
    b, sk, d = args.batch, args.keys, args.head_dim
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, 1, hq, d, device=dev, dtype=torch.float16, generator=g)
    k_tm, v_tm = (torch.randn(b, sk, hk, d, device=dev, dtype=torch.float16, generator=g) for _ in range(2))
    k_hm, v_hm = (t.transpose(1, 2).contiguous() for t in (k_tm, v_tm))
    lengths = torch.full((b,), sk, dtype=torch.int32, device=dev)
    q_hm = q.transpose(1, 2)
    calls = {"torch sdpa (head-major)": lambda: F.scaled_dot_product_attention(q_hm, k_hm, v_hm, enable_gqa=True),
             "flash_attn head-major (automatic slices)": lambda: rdnattention.flash_attn(q_hm, k_hm, v_hm)}
    for s in (int(x) for x in args.splits.split(",")):
        calls[f"kvcache token-major, splits {s or 'auto'}"] = (
            lambda s=s: rdnattention.flash_attn_with_kvcache(q, k_tm, v_tm, cache_seqlens=lengths, num_splits=s))
        calls[f"kvcache head-major (a transposed view), splits {s or 'auto'}"] = (
            lambda s=s: rdnattention.flash_attn_with_kvcache(q, k_hm.transpose(1, 2), v_hm.transpose(1, 2),
                                                              cache_seqlens=lengths, num_splits=s))
    best = {name: float("inf") for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            best[name] = min(best[name], stream_ms(fn, reps=50, warmup=5, rounds=1))
    gb = 2 * b * hk * sk * d * 2 / 1e9
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}: batch {b}, heads {hq}/{hk}, {sk} keys, "
          f"head_dim {d}; the least of {args.rounds} rounds\n")
    print("| call | ms | GB/s | / sdpa |\n|---|---|---|---|")
    ref = best["torch sdpa (head-major)"]
    for name, ms in best.items():
        print(f"| {name} | {ms:.4f} | {gb / ms * 1e3:.0f} | {ref / ms:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
