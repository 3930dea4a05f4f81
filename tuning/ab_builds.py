"""A/B two builds of the same kernels on a GPU, interleaved (A B A B ...), launches only.

    python -m tuning.ab_builds --a build --b path/to/other/build

Both builds must hold the same target's kernels under the same names (a code object from another
revision with this revision's dispatch.json beside it, for instance). For each bench.py shape the
call is planned once against A's table; B runs the same launches from B's code object. Medians of
--rounds rounds, each timing A then B (timing.interleaved_ms)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from rdnattention import dispatch, drivers, plan_flash_attn

from .bench import SHAPES, flops, shape_inputs
from .timing import interleaved_ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=Path, required=True)
    p.add_argument("--b", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    device = torch.device("cuda")
    target = drivers.target_of(device)
    table_a = dispatch.load_table(args.a / target / "dispatch.json")
    table_b = dispatch.load_table(args.b / target / "dispatch.json")
    print(f"GPU: {torch.cuda.get_device_name(device)}; A {table_a.code_object}, B {table_b.code_object}\n")
    print("| shape | causal | A TFLOP/s | B TFLOP/s | A / B |\n|---|---|---|---|---|")
    for label, b, hq, hk, sq, sk, d, causal in SHAPES:
        q, k, v = shape_inputs(b, hq, hk, sq, sk, d, device)
        plan = plan_flash_attn(q, k, v, is_causal=causal)
        plans = {"a": dataclasses.replace(plan, table=table_a), "b": dataclasses.replace(plan, table=table_b)}
        ms = interleaved_ms(plans, args.rounds)
        f = flops(b, hq, sq, sk, d, causal)
        ta, tb = (f / ms[x] / 1e9 for x in "ab")
        print(f"| {label} | {causal} | {ta:.2f} | {tb:.2f} | {ta / tb:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
