"""Split-KV decode variants on a GPU, interleaved: builds (tiles, register budgets) and slice counts.

    python -m tuning.decode_sweep --builds A=build B=build/other [--splits 1,4,8,16,32]

Each build is a build directory holding this GPU's target (dispatch.json and code object). Every
decode shape of bench.py (DECODE) is planned against each build's table with the automatic slice
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", nargs="+", required=True, help="LABEL=DIR")
    p.add_argument("--splits", default="", help="slice counts to try on the first build, e.g. 1,8,16,32")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda")
    target = drivers.target_of(device)
    tables = {}
    for item in args.builds:
        label, _, path = item.partition("=")
        tables[label] = dispatch.load_table(Path(path) / target / "dispatch.json")
    splits = [int(s) for s in args.splits.split(",") if s]
    print(f"GPU: {torch.cuda.get_device_name(device)}; automatic slices fill one wave of each kernel's resident "
          "workgroups\n")
    for shape in DECODE:
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
