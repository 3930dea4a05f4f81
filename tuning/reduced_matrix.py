"""A tree's sm_90 kernels at a few head_dims alone, for timing revisions against each other quickly
(ab_trees.py): its variants.yaml and tuned overlay cut to head_dim 128 (and, for the split-KV decode,
64 too), built into TREE/build. Every family keeps its tiles, tuned entries and target settings at
those head_dims, so the kernels built are the ones the full build has there.

    python -m tuning.reduced_matrix ../old-checkout [--target sm_90] [--head-dims 128] [--decode-head-dims 64,128]

Works on any revision whose matrix has the kernels / tiles / targets sections (the generator of
that tree builds it: `python -m rdnattention_gen.cli build` run inside it)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml


def _dims(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def reduce_matrix(matrix: dict, keep: list[int], keep_decode: list[int]) -> dict:
    """``matrix`` (a parsed variants.yaml) with each family's head_dims cut to ``keep`` (the decode
    families' to ``keep_decode``; a family with none of them keeps its largest, as the append and
    quant families' one kernel), and every list and table that names head_dims cut alike."""
    kept: dict[str, set[int]] = {}
    for family, spec in matrix["kernels"].items():
        wanted = set(keep_decode if family == "dec" else keep)
        dims = [h for h in spec["head_dims"] if h in wanted] or spec["head_dims"][-1:]
        spec["head_dims"] = dims
        for option in ("layouts", "dtypes", "scores"):
            if option in spec:
                cut = {name: [h for h in hs if h in dims] for name, hs in spec[option].items()}
                spec[option] = {name: hs for name, hs in cut.items() if hs}
                if not spec[option]:
                    del spec[option]
        kept[family] = set(dims)
    for table in matrix["tiles"].values():
        for key, spec in table.items():
            family = key.split("_")[0] if isinstance(key, str) else None
            if isinstance(spec, dict) and family in kept:
                for h in [h for h in spec if isinstance(h, int) and h not in kept[family]]:
                    del spec[h]
    for target in matrix["targets"].values():
        if isinstance(target, dict) and isinstance(target.get("head_dims"), dict):
            for family, dims in target["head_dims"].items():
                if family in kept and isinstance(dims, list):
                    target["head_dims"][family] = [h for h in dims if h in kept[family]] or sorted(kept[family])
    return matrix


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--target", default="sm_90")
    p.add_argument("--head-dims", type=_dims, default=[128])
    p.add_argument("--decode-head-dims", type=_dims, default=[64, 128])
    args = p.parse_args()
    tree = args.tree.resolve()
    generator = tree / "rdnattention_gen"
    out = tree / "build"
    out.mkdir(exist_ok=True)
    matrix = reduce_matrix(yaml.safe_load((generator / "variants.yaml").read_text()), args.head_dims,
                           args.decode_head_dims)
    (out / "reduced_variants.yaml").write_text(yaml.safe_dump(matrix, sort_keys=False))
    tuned_dir = out / "reduced_tuned"
    tuned_dir.mkdir(exist_ok=True)
    overlay = generator / "tuned" / f"{args.target}.yaml"
    if overlay.exists():
        tuned = yaml.safe_load(overlay.read_text())
        tuned["entries"] = [e for e in tuned.get("entries", [])
                            if e["head_dim"] in set(matrix["kernels"].get(e["family"], {}).get("head_dims", ()))
                            or (e["family"] in ("dec", "decpaged") and e["head_dim"] in args.decode_head_dims)]
        (tuned_dir / f"{args.target}.yaml").write_text(yaml.safe_dump(tuned, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([sys.executable, "-m", "rdnattention_gen.cli", "build", "--targets", args.target,
                           "--variants", str(out / "reduced_variants.yaml"), "--tuned", str(tuned_dir),
                           "--build-dir", str(out)], cwd=tree, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main())
