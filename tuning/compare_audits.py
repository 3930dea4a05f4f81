"""Compare two `rdnattention-gen audit --json` outputs kernel by kernel: the same names, VGPRs within
4, and spills, scratch, LDS and instruction counts equal. Only the targets of the first file are
compared. Exits 1 on any difference.

    rdnattention-gen audit --json --targets all > after.json
    python -m tuning.compare_audits before.json after.json
"""

from __future__ import annotations

import json
import sys

EXACT = ("sgpr_spills", "vgpr_spills", "scratch_bytes", "lds_bytes", "dot2", "dot4", "fma_mix", "mad_mix",
         "cvt_f32_f16")
VGPR_SLACK = 4


def _load(path: str) -> dict[tuple[str, str], dict]:
    with open(path) as f:
        return {(r["target"], r["name"]): r for r in json.load(f)}


def main(argv: list[str]) -> int:
    before, after = _load(argv[0]), _load(argv[1])
    targets = {t for t, _ in before}
    after = {k: v for k, v in after.items() if k[0] in targets}
    print(f"before: {len(before)} kernels, after: {len(after)} kernels over {len(targets)} targets")
    missing, extra = sorted(set(before) - set(after)), sorted(set(after) - set(before))
    print(f"names only before: {len(missing)}, names only after: {len(extra)}")
    problems, deltas = [], []
    for key in sorted(set(before) & set(after)):
        b, a = before[key], after[key]
        problems += [f"{key[0]}/{key[1]}: {f} {b[f]} -> {a[f]}" for f in EXACT if b[f] != a[f]]
        if b["vgprs"] is not None:
            deltas.append(a["vgprs"] - b["vgprs"])
            if abs(deltas[-1]) > VGPR_SLACK:
                problems.append(f"{key[0]}/{key[1]}: vgprs {b['vgprs']} -> {a['vgprs']}")
    print(f"fields compared exactly: {', '.join(EXACT)}")
    if deltas:
        print(f"VGPR change: min {min(deltas)}, max {max(deltas)}, unchanged in "
              f"{sum(d == 0 for d in deltas)} of {len(deltas)}")
    print("\n".join(problems) if problems else "every kernel matches")
    return 1 if problems or missing or extra else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
