"""Time kernels of one build against each other on a GPU, interleaved (A B A B ...), with the
dispatch choice forced per run: how a tile or a `when:` entry is justified before it goes into
variants.yaml or tuned/<target>.yaml.

    python -m tuning.compare_kernels --tiles br128_bc64_nt256_tm8,br64_bc64_nt128_tm8 --causal

For each shape and tile, the kernel of the build whose name holds the tile and that serves the
call (largest GQA group first); TFLOP/s with FLOPs = 4*B*H*Sq*Sk*D (halved for causal when
Sq == Sk), median over rounds; each round times every kernel once (timing.interleaved_ms)."""

from __future__ import annotations

import argparse

import torch

from rdnattention import dispatch, drivers, plan_flash_attn
from rdnattention.errors import UnsupportedError

from .bench import SHAPES, flops, shape_inputs
from .timing import interleaved_ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", required=True, help="comma list of tile spellings as in kernel names")
    p.add_argument("--causal", action="store_true", help="only the causal shapes of bench.py")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda")
    table = dispatch.table_for(drivers.target_of(device))
    tiles = args.tiles.split(",")
    print(f"GPU: {torch.cuda.get_device_name(device)}; target {table.target}; torch {torch.__version__}\n")
    print("| shape | causal | " + " | ".join(tiles) + " |\n|---|---|" + "---|" * len(tiles))
    for label, b, hq, hk, sq, sk, d, causal in SHAPES:
        if args.causal and not causal or sq == 1:
            continue
        q, k, v = shape_inputs(b, hq, hk, sq, sk, d, device)
        plans = {}
        for tile in tiles:
            names = sorted((e for e in table.kernels if e.head_dim == d and f"_{tile}_" in e.name),
                           key=lambda e: -e.gqa_group)
            for e in names:
                try:
                    plans[tile] = plan_flash_attn(q, k, v, is_causal=causal, kernel=e.name)
                    break
                except UnsupportedError:
                    continue
        ms = interleaved_ms(plans, args.rounds)
        f = flops(b, hq, sq, sk, d, causal)
        cells = [f"{f / ms[t] / 1e9:.2f}" if t in ms else "-" for t in tiles]
        print(f"| {label} | {causal} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
