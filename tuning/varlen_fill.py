"""Eager cost of the packed entry points with and without a fill of the output before the launch, in
one process, interleaved (five rounds; back-to-back: the least, one call: the median).

    python -m tuning.varlen_fill

The kernels write the rows past the last sequence themselves (fa2_zero_rows_past_sequences), so the
runtime allocates the packed output without a fill; "fill + kernels" zero-fills it first, as the
runtime did before (torch.zeros_like: one more launch), on the same kernels. Every varlen case of
tuning/overhead.py, beside torch SDPA on the same shapes (the padded batch)."""

from __future__ import annotations

import statistics

import torch


def main() -> int:
    from rdnattention import decode

    from .overhead import CASES
    from .timing import host_us, one_call_us

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    device, sync = torch.device("cuda"), torch.cuda.synchronize
    real = decode.allocate

    def filled(q, return_lse, packed, **kw):
        out, lse = real(q, return_lse, packed, **kw)
        if packed:
            out.zero_()
        return out, lse

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}\n")
    print("| path | fill + kernels: back-to-back us | kernels alone | fill + kernels: one call us | kernels alone | "
          "torch sdpa: back-to-back us | one call us |")
    print("|---|---|---|---|---|---|---|")
    for case in CASES:
        if not case.name.startswith("varlen"):
            continue
        ours, sdpa = case.build(device)
        t: dict[str, list[float]] = {k: [] for k in ("fill", "none", "fill1", "none1", "sdpa", "sdpa1")}
        for _ in range(5):
            for mode, allocate in (("fill", filled), ("none", real)):
                decode.allocate = allocate
                try:
                    t[mode].append(host_us(ours, 300, sync))
                    t[mode + "1"].append(one_call_us(ours, sync, reps=100))
                finally:
                    decode.allocate = real
            t["sdpa"].append(host_us(sdpa, 300, sync))
            t["sdpa1"].append(one_call_us(sdpa, sync, reps=100))
        print(f"| {case.name} | {min(t['fill']):.1f} | {min(t['none']):.1f} | {statistics.median(t['fill1']):.1f} | "
              f"{statistics.median(t['none1']):.1f} | {min(t['sdpa']):.1f} | {statistics.median(t['sdpa1']):.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
