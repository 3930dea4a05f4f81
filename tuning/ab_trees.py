"""A/B two source trees on a GPU, each with its own build, in alternating processes (A B A B ...).

    python -m tuning.ab_trees --a ../old-checkout --b . --rounds 3

ab_builds.py compares two builds in one process; it cannot compare revisions whose kernels' LDS
layout or arguments differ, since one runtime refuses kernels built for another layout. Here each
tree runs its own runtime and its own kernels (its build/), one process per (round, tree),
alternating, so drift on the machine falls on both. Each process times every prefill shape of its
tree's bench.py (timing.call_ms: median of 25 launches); the table gives the median over rounds
per tree, TFLOP/s, and A / B."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# Run inside each tree: that tree's bench.py shapes and timing, that tree's runtime. Trees from before
# tuning/timing.py kept the same timing loop as bench.time_ms.
_CHILD = """
import json
import torch
from tuning.bench import SHAPES, flops, shape_inputs
try:
    from tuning.timing import call_ms
except ImportError:
    from tuning.bench import time_ms as call_ms
from rdnattention import plan_flash_attn
out = []
for label, b, hq, hk, sq, sk, d, causal in SHAPES:
    if sq == 1:
        continue
    q, k, v = shape_inputs(b, hq, hk, sq, sk, d, torch.device("cuda"))
    plan = plan_flash_attn(q, k, v, is_causal=causal)
    out.append([label, causal, call_ms(plan.run), flops(b, hq, sq, sk, d, causal)])
print("AB_RESULT " + json.dumps(out))
"""


def run_tree(tree: Path) -> list:
    env = dict(os.environ, PYTHONPATH=str(tree), RDNATTENTION_BUILD_DIR=str(tree / "build"))
    done = subprocess.run([sys.executable, "-c", _CHILD], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: the timing process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    line = next((x for x in done.stdout.splitlines() if x.startswith("AB_RESULT ")), None)
    if line is None:
        raise SystemExit(f"{tree}: the timing process printed no result:\n{done.stdout[-4000:]}")
    return json.loads(line[len("AB_RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", type=Path, required=True, help="a source tree with its build")
    p.add_argument("--b", type=Path, required=True, help="another source tree with its build")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    times: dict[str, list[list]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for name, tree in trees.items():
            times[name].append(run_tree(tree))
            print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr)
    print(f"A {trees['a']}, B {trees['b']}; medians of {args.rounds} processes each\n")
    print("| shape | causal | A TFLOP/s | B TFLOP/s | A / B |\n|---|---|---|---|---|")
    for i, (label, causal, _, f) in enumerate(times["a"][0]):
        ta, tb = (f / statistics.median(run[i][2] for run in times[x]) / 1e9 for x in "ab")
        print(f"| {label} | {causal} | {ta:.2f} | {tb:.2f} | {ta / tb:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
