"""The score transforms of the prefill kernels against the float64 oracle, on one build: the largest
error of the output and of the LSE per transform and dtype, over head_dims, masks (full, causal, a
two-sided window), GQA and shapes with fewer queries than keys. For checking a kernel revision's
transforms on a GPU quickly (the GPU tests run every kernel; this runs the calls a bench times).

    RDNATTENTION_BUILD_DIR=build/ab_new python -m tuning.score_accuracy --device cuda --head-dims 64,128
"""

from __future__ import annotations

import argparse

import torch

import rdnattention
from rdnattention.reference import attention_reference

SHAPES = ((1, 4, 4, 700, 700), (2, 4, 2, 257, 513), (1, 2, 1, 1, 300), (1, 8, 4, 300, 200))
MASKS = ((False, (-1, -1)), (True, (-1, -1)), (False, (100, 37)))


def transforms(b: int, hq: int, g: torch.Generator) -> dict[str, dict]:
    """Each transform (and two pairs of them) with the values a call passes: a large and a small
    softcap, one under a negative softmax scale, ALiBi slopes per head and per batch and head."""
    return {"softcap 50": dict(softcap=50.0), "softcap 5": dict(softcap=5.0),
            "softcap 30, scale -0.2": dict(softcap=30.0, softmax_scale=-0.2),
            "alibi": dict(alibi_slopes=torch.rand(hq, generator=g) * 0.3),
            "alibi per batch": dict(alibi_slopes=torch.rand(b, hq, generator=g) * 0.3 - 0.1),
            "softcap and alibi": dict(softcap=20.0, alibi_slopes=torch.rand(hq, generator=g) * 0.3),
            "softcap and sinks": dict(softcap=20.0, sinks=torch.randn(hq, generator=g))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--head-dims", default="64,128")
    args = p.parse_args()
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    worst: dict[tuple[str, str], tuple[float, float]] = {}
    for d in (int(x) for x in args.head_dims.split(",")):
        for dtype in (torch.float16, torch.bfloat16):
            for b, hq, hk, sq, sk in SHAPES:
                for causal, window in MASKS:
                    for name, kw in transforms(b, hq, g).items():
                        q = (torch.randn(b, hq, sq, d, generator=g) * 2).to(dtype)
                        k = (torch.randn(b, hk, sk, d, generator=g) * 2).to(dtype)
                        v = torch.randn(b, hk, sk, d, generator=g).to(dtype)
                        on_dev = {n: t.to(dev) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
                        o, lse = rdnattention.flash_attn(q.to(dev), k.to(dev), v.to(dev), is_causal=causal,
                                                         window_size=window, return_lse=True, **on_dev)
                        ro, rl = attention_reference(q, k, v, is_causal=causal, window_size=window, return_lse=True,
                                                     **kw)
                        eo = (o.double().cpu() - ro).abs().max().item()
                        seen = torch.isfinite(rl)  # rows that see a key
                        el = (lse.double().cpu()[seen] - rl[seen]).abs().max().item() if seen.any() else 0.0
                        key = (name, str(dtype).removeprefix("torch."))
                        old = worst.get(key, (0.0, 0.0))
                        worst[key] = (max(old[0], eo), max(old[1], el))
    print("| transform | dtype | largest output error | largest LSE error |")
    print("|---|---|---|---|")
    for (name, dtype), (eo, el) in sorted(worst.items()):
        print(f"| {name} | {dtype} | {eo:.2e} | {el:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
