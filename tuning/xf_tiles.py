"""The score-option xf kernels (softcap, sinks) of several tiles in one build, forced by name and
timed in turn from CUDA-graph replays beside the plain causal call of the same tensors: what each
tile costs a softcap and sinks against plain (the goal: at most 5%), and how far each tile's output
lies from the first's.

    RDNATTENTION_BUILD_DIR=DIR python -m tuning.xf_tiles --tiles br128_bc64_nt128_tm8,br64_bc32_nt128_tm4

The build must hold the xf kernels of every tile at head_dim 64 (a matrix whose f16_xf table gives
one tile, beside the tuned overlay's: tuning/reduced_matrix.py on such a tree)."""

from __future__ import annotations

import argparse

import torch

from rdnattention import plan_flash_attn

from .bench import shape_inputs
from .timing import graph_ms

SHAPES = [("1x32x2048x64 causal", 1, 32, 32, 2048, 2048, 64),
          ("bloom-560m B4 16/16 S1024 D64 causal", 4, 16, 16, 1024, 1024, 64),
          ("gpt-oss 64/8 S4096 D64 causal", 1, 64, 8, 4096, 4096, 64)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiles", required=True, help="comma list of tiles, e.g. br128_bc64_nt128_tm8")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    tiles = args.tiles.split(",")
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(dev)}; cost against plain causal, CUDA-graph replays\n")
    print("| shape | plain ms | " + " | ".join(f"{w} {t}" for t in tiles for w in ("softcap", "sinks")) + " |")
    print("|---|---|" + "---|" * (2 * len(tiles)))
    for label, b, hq, hk, sq, sk, d in SHAPES:
        q, k, v = shape_inputs(b, hq, hk, sq, sk, d, dev)
        group = "g2" if hq // hk > 1 else "g1"  # the tiles of GQA calls hold two query heads' rows
        sinks = torch.randn(hq, device=dev)
        plans = {"plain": plan_flash_attn(q, k, v, is_causal=True)}
        for t in tiles:
            name = f"fa2_f16_xf_hd{d}_{group}_{t}_w32_cvt_fma_sf32"
            plans[("softcap", t)] = plan_flash_attn(q, k, v, is_causal=True, softcap=50.0, kernel=name)
            plans[("sinks", t)] = plan_flash_attn(q, k, v, is_causal=True, sinks=sinks, kernel=name)
        ms = graph_ms(plans, args.rounds)
        cells = [f"{100 * (ms[(w, t)] / ms['plain'] - 1):+.1f}%" for t in tiles for w in ("softcap", "sinks")]
        print(f"| {label} | {ms['plain']:.4f} | " + " | ".join(cells) + " |")
        for w in ("softcap", "sinks"):
            plans[(w, tiles[0])].run()
            first = plans[(w, tiles[0])].outputs[0].float().clone()
            for t in tiles[1:]:
                plans[(w, t)].run()
                gap = (plans[(w, t)].outputs[0].float() - first).abs().max().item()
                print(f"  ({w}: {t}'s output within {gap:.1e} of {tiles[0]}'s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
