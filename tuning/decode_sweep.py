"""Split-KV decode variants on a GPU, interleaved: builds (tiles, register budgets) and slice counts.

    python -m tuning.decode_sweep --builds A=build B=build/other [--splits 1,4,8,16,32] [--shapes generate]

Each build is a build directory holding this GPU's target (dispatch.json and code object). Every
decode shape of bench.py (DECODE; with ``--shapes generate``, GENERATE: the short caches of a
Hugging Face generate() step, batch 1 and 8, GQA 32/8, head_dim 128; ``--shapes gqa``, GQA: batch-1
GQA decode over longer caches) is planned against each build's table with the automatic slice
count, and with each --splits count on the first build; all plans of a shape are timed in turn,
--rounds times from CUDA-graph replays (timing.graph_ms), torch SDPA among them. GB/s counts the K
and V bytes read."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rdnattention import dispatch, drivers
from rdnattention.families import dec

from .bench import DECODE, SdpaPlan, decode_bytes, decode_inputs
from .timing import graph_ms


# The decode steps of tuning/generate.py's model (heads 32/8, head_dim 128) on the caches its
# generate() grows through (prompt 128 plus up to 128 new tokens) and a few longer ones.
GENERATE = [(f"generate batch {b} GQA 32/8 Sk{sk} D128", b, 32, 8, 1, sk, 128, None)
            for b in (1, 8) for sk in (128, 256, 512, 1024, 2048)]


# Batch-1 GQA decode over longer caches: few K/V heads, so the slices carry the parallelism.
GQA = [("decode GQA 32/8 Sk4096 D128", 1, 32, 8, 1, 4096, 128, None),
       ("decode GQA 32/8 Sk8192 D128", 1, 32, 8, 1, 8192, 128, None),
       ("decode GQA 32/8 Sk16384 D128", 1, 32, 8, 1, 16384, 128, None),
       ("decode GQA 64/8 Sk8192 D64", 1, 64, 8, 1, 8192, 64, None)]
SHAPES = {"decode": DECODE, "generate": GENERATE, "gqa": GQA}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", nargs="+", required=True, help="LABEL=DIR")
    p.add_argument("--splits", default="", help="slice counts to try on the first build, e.g. 1,8,16,32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shapes", choices=tuple(SHAPES), default="decode",
                   help="decode: bench.py's long caches (default); generate: generate()'s short ones; gqa: "
                        "batch-1 GQA decode over 4096-16384 keys")
    args = p.parse_args()
    device = torch.device("cuda")
    target = drivers.target_of(device)
    tables = {}
    for item in args.builds:
        label, _, path = item.partition("=")
        tables[label] = dispatch.load_table(Path(path) / target / "dispatch.json")
    splits = [int(s) for s in args.splits.split(",") if s]
    print(f"GPU: {torch.cuda.get_device_name(device)}; automatic slices: at most one wave of each kernel's "
          "resident workgroups, of at least MIN_SLICE_KEYS keys each unless one workgroup per unit asks for more "
          "(_splitkv.splits_for)\n")
    for shape in SHAPES[args.shapes]:
        label = shape[0]
        q, k, v, call = decode_inputs(shape, device)
        plans = {"sdpa": SdpaPlan(q, k, v)}
        for name, table in tables.items():
            plans[name] = dec.plan(table, call)
        first = next(iter(tables.values()))
        for s in splits:
            plans[f"{next(iter(tables))} s{s}"] = dec.plan(first, dec.Call(**{**call.__dict__, "num_splits": s}))
        ms = graph_ms(plans, args.rounds)
        gb = decode_bytes(shape) / 1e9
        print(f"### {label}\n\n| plan | slices | kernel | ms | GB/s | / sdpa |\n|---|---|---|---|---|---|")
        for name, plan in plans.items():
            launches = getattr(plan, "launches", None)
            slices = launches[0].args.splits if launches else "-"
            kernel = launches[0].kernel.name if launches else "torch sdpa"
            print(f"| {name} | {slices} | {kernel} | {ms[name]:.4f} | {gb / ms[name] * 1e3:.0f} | "
                  f"{ms['sdpa'] / ms[name]:.2f}x |")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
