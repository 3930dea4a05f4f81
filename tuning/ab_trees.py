"""A/B two source trees on a GPU, each with its own build, in alternating processes (A B A B ...).

    python -m tuning.ab_trees --a ../old-checkout --b . --rounds 3
    python -m tuning.ab_trees --a ../old-checkout --b . --decode     # the split-KV decode shapes

Builds for it: `python -m tuning.reduced_matrix TREE` builds a tree's sm_90 kernels at head_dim 128
(and the decode's 64) alone, in under a minute, into TREE/build.

ab_builds.py compares two builds in one process; it cannot compare revisions whose kernels' LDS
layout or arguments differ, since one runtime refuses kernels built for another layout. Here each
tree runs its own runtime and its own kernels (its build/), one process per (round, tree),
alternating, so drift on the machine falls on both. Each process times every prefill shape of its
tree's bench.py (timing.call_ms: median of 25 launches); the table gives the median over rounds
per tree, TFLOP/s, and A / B. With ``--decode``, each process times the decode shapes of _DECODE
through the public flash_attn, plain and with each score transform, from CUDA-graph replays (the
least of 3 replays of 20 calls), beside torch SDPA's plain calls: GPU time, without the host's.
The child uses nothing of its tree but the public API, so that any revision runs it."""

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


# (label, batch, heads_q, heads_kv, seq_q, seq_k, head_dim, the score transforms timed too)
_DECODE = [("GQA 32/8 Sk32768 D128", 1, 32, 8, 1, 32768, 128, False),
           ("GQA 32/8 Sk8192 D128", 1, 32, 8, 1, 8192, 128, False),
           ("GQA 32/8 Sk512 D128", 1, 32, 8, 1, 512, 128, False),
           ("GQA 32/8 Sk8192 D128 batch 8", 8, 32, 8, 1, 8192, 128, True),
           ("Sq4 H32 Sk8192 D128", 1, 32, 32, 4, 8192, 128, False),
           ("H32 Sk8192 D128", 1, 32, 32, 1, 8192, 128, False),
           ("GQA 64/8 Sk8192 D64", 1, 64, 8, 1, 8192, 64, True)]

_CHILD_DECODE = """
import json, sys
import torch
import torch.nn.functional as F
import rdnattention

def graph_ms(fn, calls=20):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best

torch.manual_seed(0)
dev = torch.device("cuda")
out = []
for label, b, hq, hk, sq, sk, d, transforms in json.loads(sys.argv[1]):
    q = torch.randn(b, hq, sq, d, device=dev, dtype=torch.float16)
    k, v = (torch.randn(b, hk, sk, d, device=dev, dtype=torch.float16) for _ in range(2))
    runs = {"plain": {}}
    if transforms:
        runs.update(softcap=dict(softcap=30.0), alibi=dict(alibi_slopes=torch.rand(hq, device=dev) * 0.1),
                    sinks=dict(sinks=torch.randn(hq, device=dev)))
    for name, kw in runs.items():
        out.append([label, name, graph_ms(lambda: rdnattention.flash_attn(q, k, v, **kw))])
    out.append([label, "sdpa", graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hk))])
print("AB_RESULT " + json.dumps(out))
"""


def run_tree(tree: Path, decode: bool = False) -> list:
    env = dict(os.environ, PYTHONPATH=str(tree), RDNATTENTION_BUILD_DIR=str(tree / "build"))
    argv = ["-c", _CHILD_DECODE, json.dumps(_DECODE)] if decode else ["-c", _CHILD]
    done = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True)
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
    p.add_argument("--decode", action="store_true", help="the split-KV decode shapes (_DECODE) instead of prefill")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    times: dict[str, list[list]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for name, tree in trees.items():
            times[name].append(run_tree(tree, args.decode))
            print(f"round {r + 1}/{args.rounds}: {name} done", file=sys.stderr)
    print(f"A {trees['a']}, B {trees['b']}; medians of {args.rounds} processes each\n")
    if args.decode:
        print("| shape | call | A us | B us | A / B time |\n|---|---|---|---|---|")
        for i, (label, call, _) in enumerate(times["a"][0]):
            ta, tb = (statistics.median(run[i][2] for run in times[x]) * 1e3 for x in "ab")
            print(f"| {label} | {call} | {ta:.1f} | {tb:.1f} | {ta / tb:.3f} |")
        return 0
    print("| shape | causal | A TFLOP/s | B TFLOP/s | A / B |\n|---|---|---|---|---|")
    for i, (label, causal, _, f) in enumerate(times["a"][0]):
        ta, tb = (f / statistics.median(run[i][2] for run in times[x]) / 1e9 for x in "ab")
        print(f"| {label} | {causal} | {ta:.2f} | {tb:.2f} | {ta / tb:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
