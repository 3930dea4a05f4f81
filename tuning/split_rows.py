"""Where split-KV decode stops beating the row-block kernels, on a GPU: the crossover behind
route.SPLIT_KV_MAX_ROWS and route.split_kv_preferred.

    python -m tuning.split_rows [--rounds 5]

For each shape (GQA and MHA, 1 to 32 query rows per sequence, short and long caches), the call is
planned twice on this GPU's table, once by each fp16 algorithm (the row-block kernels and the
split-KV kernels with their automatic slice count), and the two plans and torch's SDPA are timed in
turn from CUDA-graph replays (timing.graph_ms). The last column is what the router picks today."""

from __future__ import annotations

import argparse

import torch

from rdnattention import drivers, route
from rdnattention.call import Attention

from .bench import SdpaPlan, shape_inputs
from .timing import graph_ms

SHAPES = [  # batch, heads, heads_kv, seq_q, seq_k
    (1, 32, 8, 1, 8192), (1, 32, 8, 2, 8192), (1, 32, 8, 4, 8192), (1, 32, 8, 8, 8192), (1, 32, 8, 16, 8192),
    (1, 32, 8, 32, 8192), (1, 32, 8, 4, 1024), (1, 32, 8, 4, 32768), (1, 32, 4, 4, 8192), (1, 32, 32, 4, 8192),
    (1, 32, 32, 8, 8192), (1, 32, 32, 16, 8192), (4, 32, 8, 4, 8192), (8, 32, 8, 4, 8192), (1, 64, 8, 4, 8192),
    (8, 32, 8, 16, 8192), (16, 32, 8, 8, 8192), (32, 32, 8, 4, 8192), (8, 32, 32, 16, 8192), (64, 32, 8, 16, 256),
    (16, 32, 8, 16, 2048), (8, 32, 8, 32, 8192), (4, 32, 8, 64, 4096),
]


def _plan(table, q, k, v, split: bool):
    out = torch.empty_like(q)
    b, hq, sq, d = q.shape
    call = Attention(q=q, k=k, v=v, out=out, lse=None, window=(-1, -1), softmax_scale=d ** -0.5, batch=b, seq_q=sq,
                     seq_k=k.shape[2])
    algorithm = route.FP16_SPLIT_KV if split else route.FP16_ROW_BLOCKS
    return algorithm.planner(table, call)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda")
    table = route.device_table(device)
    print(f"{torch.cuda.get_device_name(device)}, target {drivers.target_of(device)}, head_dim 128, fp16\n")
    print("| batch | heads | heads_kv | seq_q | seq_k | rows per K/V head | row-block ms | blocks | split-KV ms | "
          "slices | sdpa ms | split / row-block | router today |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b, hq, hk, sq, sk in SHAPES:
        q, k, v = shape_inputs(b, hq, hk, sq, sk, 128, device)
        plans = {"rows": _plan(table, q, k, v, False), "split": _plan(table, q, k, v, True), "sdpa": SdpaPlan(q, k, v)}
        ms = graph_ms(plans, args.rounds)
        rows = hq // hk * sq
        blocks = 1
        for g in plans["rows"].launches[0].grid:
            blocks *= g
        slices = plans["split"].launches[0].args.splits
        today = "split-KV" if route.split_kv_preferred(rows, sq) else "row-block"
        print(f"| {b} | {hq} | {hk} | {sq} | {sk} | {rows} | {ms['rows']:.4f} | {blocks} | {ms['split']:.4f} | "
              f"{slices} | {ms['sdpa']:.4f} | {ms['split'] / ms['rows']:.2f} | {today} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
