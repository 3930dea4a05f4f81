"""Compare tile configurations of one target on a GPU, interleaving the runs (A B C A B C ...).

    python3 tuning/tile_sweep.py prepare --target sm_90 --head-dims 64,128 \\
        --tile 128,64,256,8 --tile 64,64,128,8          # here: one build per tile under build/sweep/
    python3 tuning/tile_sweep.py run --target sm_90     # on the GPU machine: a table of TFLOP/s

Each candidate is a copy of variants.yaml whose head_dims are reduced to the ones asked for and
whose target takes a tile table (inheriting its own) that gives them the candidate; a candidate
the target cannot hold is reported and skipped. Shapes: [1, 32, 2048, D], causal and not."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "build" / "sweep"


def prepare(args: argparse.Namespace) -> int:
    from rdnattention_gen import DEFAULT_VARIANTS, build
    from rdnattention_gen.audit import AuditError
    from rdnattention_gen.matrix import load_matrix
    from rdnattention_gen.strict_yaml import VariantsError

    base = yaml.safe_load(DEFAULT_VARIANTS.read_text())
    head_dims = [int(h) for h in args.head_dims.split(",")]
    labels = []
    for tile in args.tile:
        br, bc, threads, tm = (int(x) for x in tile.split(","))
        label = f"br{br}_bc{bc}_nt{threads}_tm{tm}"
        target = dict(base["targets"][args.target])
        base["tiles"]["sweep"] = {"inherit": target["tiles"],
                                  "f16": {h: {"br": br, "bc": bc, "threads": threads, "tm": tm} for h in head_dims}}
        target["tiles"] = "sweep"
        base["targets"] = {args.target: target}  # other targets' budgets do not apply
        base["kernels"]["f16"]["head_dims"] = head_dims
        for table in base["tiles"].values():  # tile tables may only list head_dims that are built
            table["f16"] = {h: t for h, t in table.get("f16", {}).items() if h == "default" or h in head_dims}
        out = SWEEP / label
        out.mkdir(parents=True, exist_ok=True)
        (out / "variants.yaml").write_text(yaml.safe_dump(base, sort_keys=False))
        try:
            matrix = load_matrix(out / "variants.yaml", tuned_dir=None)
            build.build(matrix, matrix.select(args.target), out, log=lambda *_: None)
        except (VariantsError, build.BuildError, AuditError) as e:  # a candidate that fails scores nothing
            print(f"{label}: skipped ({str(e).splitlines()[0]})")
            continue
        labels.append(label)
        print(f"{label}: built")
    (SWEEP / "labels.json").write_text(json.dumps({"target": args.target, "head_dims": head_dims, "labels": labels}))
    return 0


def run(args: argparse.Namespace) -> int:
    meta = json.loads((SWEEP / "labels.json").read_text())
    results: dict[tuple[str, int, bool], list[float]] = {}
    for rep in range(args.reps):
        for label in meta["labels"]:
            env = dict(os.environ, RDNATTENTION_BUILD_DIR=str(SWEEP / label))
            out = subprocess.run([sys.executable, __file__, "_time", ",".join(map(str, meta["head_dims"]))],
                                 env=env, capture_output=True, text=True)
            if out.returncode:
                print(f"{label}: failed\n{out.stderr[-2000:]}")
                continue
            for line in out.stdout.splitlines():
                hd, causal, tflops = line.split()
                results.setdefault((label, int(hd), causal == "True"), []).append(float(tflops))
    print("| tile | head_dim | causal | TFLOP/s (median of runs) |\n|---|---|---|---|")
    for (label, hd, causal), values in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        print(f"| {label} | {hd} | {causal} | {statistics.median(values):.2f} |")
    return 0


def _time(head_dims: str) -> int:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import time_ms

    from rdnattention import plan_flash_attn

    for hd in (int(h) for h in head_dims.split(",")):
        q, k, v = (torch.randn(1, 32, 2048, hd, device="cuda", dtype=torch.float16) for _ in range(3))
        for causal in (False, True):
            ms = time_ms(plan_flash_attn(q, k, v, is_causal=causal).run, reps=20)
            flops = 4 * 32 * 2048 * 2048 * hd / (2 if causal else 1)
            print(hd, causal, flops / ms / 1e9)
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_time":
        return _time(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--target", required=True)
    a.add_argument("--head-dims", default="64,128")
    a.add_argument("--tile", action="append", required=True, help="br,bc,threads,tm")
    r = sub.add_parser("run")
    r.add_argument("--target", required=True)
    r.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    return prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    raise SystemExit(main())
