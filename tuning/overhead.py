"""Host-side cost per call: wall time of a tiny decode step (1x32x1x128 against 64 keys) called
in a loop with one synchronisation at the end, for flash_attn and, in the same run, torch's
scaled_dot_product_attention.

    python -m tuning.overhead            # a GPU if there is one, and the CPU path with the launch excluded

On the CPU the emulator's launch is replaced by a no-op for the measurement, so the figure is the
Python (validation, dispatch, planning, argument packing) around it."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from rdnattention import dispatch, drivers, flash_attn
from rdnattention.drivers import host
from rdnattention.errors import KernelsNotBuiltError

from .timing import host_us


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true", help="also print where the time of the GPU calls goes")
    args = p.parse_args()
    shape_q, shape_kv = (1, 32, 1, 128), (1, 32, 64, 128)
    print("| device | flash_attn us/call | torch sdpa us/call | ratio |\n|---|---|---|---|")
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        q = torch.randn(shape_q, device=dev, dtype=torch.float16)
        k, v = (torch.randn(shape_kv, device=dev, dtype=torch.float16) for _ in range(2))
        with torch.inference_mode():
            ours = host_us(lambda: flash_attn(q, k, v), args.calls, torch.cuda.synchronize)
            sdpa = host_us(lambda: F.scaled_dot_product_attention(q, k, v), args.calls, torch.cuda.synchronize)
        print(f"| {torch.cuda.get_device_name(dev)} | {ours:.1f} | {sdpa:.1f} | {ours / sdpa:.2f}x |")
        if args.profile:
            import cProfile
            import pstats
            profile = cProfile.Profile()
            with torch.inference_mode():
                profile.runcall(lambda: [flash_attn(q, k, v) for _ in range(2000)])
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)
    q = torch.randn(shape_q, dtype=torch.float16)
    k, v = (torch.randn(shape_kv, dtype=torch.float16) for _ in range(2))
    try:
        dispatch.table_for(drivers.target_of(q.device))
    except KernelsNotBuiltError as e:
        print(f"| CPU | not measured: {e} | - | - |")
        return 0
    launch = host.launch_kernel
    host.launch_kernel = lambda *a, **kw: None  # measure the Python around the launch
    try:
        with torch.inference_mode():
            ours = host_us(lambda: flash_attn(q, k, v), args.calls, lambda: None)
    finally:
        host.launch_kernel = launch
    with torch.inference_mode():
        sdpa = host_us(lambda: F.scaled_dot_product_attention(q, k, v), args.calls, lambda: None)
    print(f"| CPU, launch excluded | {ours:.1f} | {sdpa:.1f} (runs the math) | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
