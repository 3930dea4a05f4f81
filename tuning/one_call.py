"""One call with the GPU idle before it, taken apart: the host's time inside the call, then the wait
for the GPU after it returns, rdnattention beside torch's SDPA on the same shapes (overhead.py's
decode and prefill cases), each the median over calls.

    python -m tuning.one_call                  # the GPU synchronised, then the call at once
    python -m tuning.one_call --idle-ms 0.5    # the host asleep 0.5 ms before each call, as a step
                                               # that waited on something else

CUDA events around each call give the GPU's span from the call's start to its end (launch latency
and kernels). What overhead.py's one-call column adds up, this separates: host work, or waiting."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

CASES = {  # name: (query rows, key heads, keys); 32 query heads, head_dim 128, fp16
    "decode.gqa.1": (1, 8, 8192),
    "decode.gqa.short": (1, 8, 64),
    "prefill": (128, 8, 128),
}


def measure(fn, reps: int, idle_s: float) -> tuple[float, float, float]:
    """Medians (us) of the host time inside ``fn``, the wait for the GPU after it and the events' span."""
    for _ in range(20):
        fn()
    host, wait, span = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        if idle_s:
            time.sleep(idle_s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        wait.append((t2 - t1) * 1e6)
        span.append(start.elapsed_time(end) * 1e3)
    return statistics.median(host), statistics.median(wait), statistics.median(span)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--idle-ms", type=float, default=0.0, help="host sleep before each call (default 0)")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tuning.one_call needs a GPU", file=sys.stderr)
        return 2
    import rdnattention
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, idle {args.idle_ms} ms before each call\n")
    print("| case | call | host us | wait after us | events us |\n|---|---|---|---|---|")
    for name, (rows, heads_kv, keys) in CASES.items():
        q = torch.randn(1, 32, rows, 128, device=device, dtype=torch.float16)
        k, v = (torch.randn(1, heads_kv, keys, 128, device=device, dtype=torch.float16) for _ in range(2))
        causal = rows > 1
        calls = {"rdnattention.flash_attn": lambda: rdnattention.flash_attn(q, k, v, is_causal=causal),
                 "torch sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)}
        for label, fn in calls.items():
            host, wait, span = measure(fn, args.reps, args.idle_ms / 1e3)
            print(f"| {name} | {label} | {host:.1f} | {wait:.1f} | {span:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
