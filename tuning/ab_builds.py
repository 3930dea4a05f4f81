"""A/B two builds of the same kernels on a GPU, interleaved (A B A B ...), launches only.

    python -m tuning.ab_builds --a build --b path/to/other/build

Both builds must hold the same target's kernels under the same names (a code object from another
revision with this revision's dispatch.json beside it, for instance). For each bench.py prefill
shape (and EXTRA's), plain, and on the causal rows with ALiBi slopes and with a logit softcap (the
f16 kernels of score options alibi and xf), the call is planned once by the runtime's table (run it
with RDNATTENTION_BUILD_DIR set to one of the two); A and B run the same launches, each from its own
code object. Medians of --rounds rounds, each timing A then B (timing.interleaved_ms). Calls either
build has no kernels for (a build narrowed to some head_dims) are left out. With --out, the table is
also written to OUT/ab_builds.md."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from rdnattention import dispatch, drivers, plan_flash_attn
from rdnattention.errors import RdnaAttentionError

from .bench import SHAPES, alibi_slopes, flops, shape_inputs
from .timing import interleaved_ms

EXTRA = [  # sm_90's head_dim 72 (its tile measured last) and a GQA shape, whose ALiBi has a branch of its own
    ("1x32x2048x72", 1, 32, 32, 2048, 2048, 72, False),
    ("1x32x2048x72", 1, 32, 32, 2048, 2048, 72, True),
    ("gpt-oss 64/8 S4096 D64", 1, 64, 8, 4096, 4096, 64, True),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=Path, required=True)
    p.add_argument("--b", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="also write the table to OUT/ab_builds.md")
    args = p.parse_args()
    device = torch.device("cuda")
    target = drivers.target_of(device)
    table_a = dispatch.load_table(args.a / target / "dispatch.json")
    table_b = dispatch.load_table(args.b / target / "dispatch.json")
    names = {e.name for e in table_a.kernels} & {e.name for e in table_b.kernels}
    lines = [f"GPU: {torch.cuda.get_device_name(device)}; A {table_a.code_object}, B {table_b.code_object}", "",
             "| shape | causal | call | A TFLOP/s | B TFLOP/s | A / B |", "|---|---|---|---|---|---|"]
    print("\n".join(lines))
    for label, b, hq, hk, sq, sk, d, causal in SHAPES + EXTRA:
        if sq == 1:
            continue
        q, k, v = shape_inputs(b, hq, hk, sq, sk, d, device)
        options = {"plain": {}}
        if causal:
            options.update(alibi={"alibi_slopes": alibi_slopes(hq, device)}, softcap={"softcap": 50.0})
        for name, kw in options.items():
            try:
                plan = plan_flash_attn(q, k, v, is_causal=causal, **kw)
            except RdnaAttentionError:  # the runtime's build has no kernel for it
                continue
            if any(launch.kernel.name not in names for launch in plan.launches):
                continue
            plans = {"a": dataclasses.replace(plan, table=table_a), "b": dataclasses.replace(plan, table=table_b)}
            ms = interleaved_ms(plans, args.rounds)
            f = flops(b, hq, sq, sk, d, causal)
            ta, tb = (f / ms[x] / 1e9 for x in "ab")
            lines.append(f"| {label} | {causal} | {name} | {ta:.2f} | {tb:.2f} | {ta / tb:.3f} |")
            print(lines[-1])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ab_builds.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
