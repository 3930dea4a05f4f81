"""How well the static cost model ranks tiles, checked on the H200: the model's share of the FFMA
peak from each tuned candidate's SASS (cuobjdump -sass; the same loop analysis the AMD audit runs
on its disassembly) against the TFLOP/s `rdnattention-gen tune --measure` recorded.

    rdnattention-gen tune --targets sm_90 --build-dir build/tune90 --no-build --measure
    python -m tuning.cost_check --build-dir build/tune90 > tuning/results/h200_cost_model.md

Per (head_dim, mask): Spearman's rank correlation between estimate and measurement, how the
model's top pick measured, and the rank the measured best had in the model's order."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from rdnattention_gen import cost
from rdnattention_gen.families import spec_from_name
from rdnattention_gen.families.f16 import padded_head_dim, threads_per_row
from rdnattention_gen.matrix import load_matrix

ROOT = Path(__file__).resolve().parent.parent


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = pos
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", type=Path, default=ROOT / "build" / "tune90")
    p.add_argument("--target", default="sm_90")
    args = p.parse_args()
    target = load_matrix().target(args.target)
    cubin = args.build_dir / args.target / "kernels.cubin"
    sass = cost.parse_sass(subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True,
                                          check=True).stdout)
    rows = {c["name"]: c["row"] for c in json.loads((args.build_dir / "tune.json").read_text())["candidates"]}
    measured = json.loads((args.build_dir / "measured.json").read_text())
    print(f"# Cost model against the H200 ({len(sass)} kernels' SASS, `{cubin.name}`)\n")
    print("| head_dim | group | causal | candidates | Spearman | model's pick: measured / best | measured best's rank in the model |")
    print("|---|---|---|---|---|---|---|")
    details = []
    for m in measured:
        est, got = {}, {}
        for name, tflops in m["figures"].items():
            spec = spec_from_name(name)
            # cvt_fma on sm_90 stages fp32 pairs: two FFMA per pair product
            per_step = 2 * spec.tile.tm * spec.tile.bc * padded_head_dim(spec) / threads_per_row(spec)
            counts = cost.loop_counts(sass.get(name, []), "FFMA", per_step, cost.SASS)
            if counts is None:
                continue
            waves = rows[name]["waves_per_simd"] if rows.get(name) else 1
            e = cost.estimate_on(target, counts, waves)
            est[name], got[name] = e.share, tflops
            details.append((m["head_dim"], m["causal"], name, waves, e.bound, e.share, tflops))
        if len(est) < 3:
            continue
        names = list(est)
        rho = spearman([est[n] for n in names], [got[n] for n in names])
        pick = max(names, key=est.get)
        best = max(names, key=got.get)
        rank = sorted(names, key=lambda n: -est[n]).index(best) + 1
        print(f"| {m['head_dim']} | {m['gqa_group']} | {m['causal']} | {len(names)} | {rho:.2f} | "
              f"{got[pick]:.2f} / {got[best]:.2f} TFLOP/s | {rank} of {len(names)} |")
    print("\n| head_dim | causal | kernel | waves/SIMD | bound | model share | measured TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for hd, causal, name, waves, bound, share, tflops in sorted(details, key=lambda d: (d[0], d[1], -d[6])):
        print(f"| {hd} | {causal} | `{name}` | {waves} | {bound} | {share:.0%} | {tflops:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
