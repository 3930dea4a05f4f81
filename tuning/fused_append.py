"""flash_attn_with_kvcache's append fused into the split-KV decode's launch, against the same call with
the append in its own launch first (kvcache.FUSE_MAX_NEW = 0), the call without new keys, and torch's
SDPA on the same shapes (overhead.py's kvcache cases, with and without RoPE tables), timed in turn round after round in one process,
so that the machine's drift between runs falls on every column alike.

    python -m tuning.fused_append --rounds 9

Each figure: the least over rounds of the back-to-back wall time per call (a loop of calls, one
synchronisation at the end; timing.host_us). The replay cache is cleared when the configuration
changes, and each round's first calls (warm-up) plan the call again."""

from __future__ import annotations

import argparse
import sys

import torch

from .overhead import _kvcache
from .timing import host_us

CASES = {
    "kvcache.contiguous.append": dict(append=True),
    "kvcache.paged.append": dict(paged=True, append=True),
    "kvcache.batch8.append": dict(append=True, batch=8),
    "kvcache.contiguous.rope": dict(append=True, rope=True),
    "kvcache.paged.rope": dict(paged=True, append=True, rope=True),
    "kvcache.batch8.rope": dict(append=True, rope=True, batch=8),
}


def _fmt(x: float) -> str:
    return f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=400, help="calls per loop (default 400)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 1
    from rdnattention import kvcache, replay

    device, sync = torch.device("cuda"), torch.cuda.synchronize
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}; least of {args.rounds} rounds of "
          f"{args.calls} calls, us per call\n")
    print("| path | fused | own launch | no new keys | torch sdpa | fused / sdpa | own launch / sdpa | fused - own |")
    print("|---|---|---|---|---|---|---|---|")
    limit = kvcache.FUSE_MAX_NEW
    for name, kw in CASES.items():
        with torch.inference_mode():
            ours, sdpa = _kvcache(**kw)(device)
            plain = {**kw, "append": False, "rope": False}
            without, _ = _kvcache(**plain)(device)
            runs = {"fused": (ours, limit), "own": (ours, 0), "none": (without, limit), "sdpa": (sdpa, limit)}
            best = {key: float("inf") for key in runs}
            for _ in range(args.rounds):
                for key, (fn, fuse) in runs.items():
                    kvcache.FUSE_MAX_NEW = fuse
                    replay.clear()
                    best[key] = min(best[key], host_us(fn, args.calls, sync, warmup=20))
            kvcache.FUSE_MAX_NEW = limit
        print(f"| {name} | {_fmt(best['fused'])} | {_fmt(best['own'])} | {_fmt(best['none'])} | "
              f"{_fmt(best['sdpa'])} | {best['fused'] / best['sdpa']:.2f}x | {best['own'] / best['sdpa']:.2f}x | "
              f"{best['fused'] - best['own']:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
