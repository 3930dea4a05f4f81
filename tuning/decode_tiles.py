"""Every split-KV decode kernel of this GPU's build that serves a decode shape, forced in turn (its
automatic slice count), and the router's kernel at forced slice counts, against the router's choice
and torch's SDPA: whether another row tile or slice count would read the keys faster.

    python -m tuning.decode_tiles --batch 8 --keys 8192 --heads 32/8 [--splits 8,16,32]

Timed from CUDA-graph replays, the plans in turn each round (timing.graph_ms); GB/s counts the K
and V bytes read. A one- or two-row kernel takes a GQA group in several row chunks, each reading
the group's keys (the later ones from the L2 cache)."""

from __future__ import annotations

import argparse
import sys

import torch

from .bench import SdpaPlan, decode_bytes, decode_inputs
from .timing import graph_ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--keys", type=int, default=8192)
    p.add_argument("--heads", default="32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--splits", default="", help="slice counts to force on the router's kernel, e.g. 8,16,32")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 1
    from rdnattention import route
    from rdnattention.errors import RdnaAttentionError
    from rdnattention.families import dec

    device = torch.device("cuda")
    hq, hk = (int(x) for x in args.heads.split("/"))
    shape = (f"batch {args.batch} GQA {hq}/{hk} Sk{args.keys} D{args.head_dim}", args.batch, hq, hk, 1, args.keys,
             args.head_dim, None)
    q, k, v, call = decode_inputs(shape, device)
    table = route.device_table(device)
    plans = {"sdpa": SdpaPlan(q, k, v), "router": dec.plan(table, call)}
    for entry in table.entries(dec.NAME, args.head_dim):
        try:
            plans[entry.name] = dec.plan(table, call, kernel=entry.name)
        except RdnaAttentionError as e:  # a kernel that does not serve the call
            print(f"{entry.name}: {e}")
    for n in (int(x) for x in args.splits.split(",") if x):
        plans[f"router's kernel, {n} slices"] = dec.plan(table, dec.Call(**{**call.__dict__, "num_splits": n}))
    ms = graph_ms(plans, args.rounds)
    gb = decode_bytes(shape) / 1e9
    print(f"\n{torch.cuda.get_device_name(device)}: {shape[0]}\n")
    print("| plan | slices | grid | ms | GB/s | / sdpa |\n|---|---|---|---|---|---|")
    for name, plan in plans.items():
        launches = getattr(plan, "launches", None)
        slices = launches[0].args.splits if launches else "-"
        grid = launches[0].grid if launches else "-"
        label = f"router: {launches[0].kernel.name}" if name == "router" else name
        print(f"| {label} | {slices} | {grid} | {ms[name]:.4f} | {gb / ms[name] * 1e3:.0f} | "
              f"{ms['sdpa'] / ms[name]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
