"""A copy of variants.yaml cut down to a few head_dims, for the tests of the generator's plumbing
(paths a shell would run, depfiles) that build targets of their own: every family, layout, dtype,
score option and tile table stays, with only the head_dims ``keep`` lists, so a target compiles in
seconds rather than minutes. Built with ``--variants`` and an empty ``--tuned`` directory (the tuned
tiles name head_dims the copy drops). ``write_one_family`` cuts further, for tests of paths alone."""

from __future__ import annotations

from pathlib import Path

import yaml

from rdnattention_gen import DEFAULT_VARIANTS

KEEP = (64, 512)  # head_dim 64 of every family; 512, the append family's one


def write(directory: Path, keep: tuple[int, ...] = KEEP, text: str | None = None) -> tuple[Path, Path]:
    """Writes the cut-down matrix (of ``text``, variants.yaml's by default) and an empty tuned
    directory into ``directory``; returns their paths."""
    data = yaml.safe_load(DEFAULT_VARIANTS.read_text() if text is None else text)
    kept = {}
    for fam, spec in data["kernels"].items():
        spec["head_dims"] = [h for h in spec["head_dims"] if h in keep]
        kept[fam] = set(spec["head_dims"])
        for section in ("layouts", "dtypes", "scores"):
            if section in spec:
                cut = {name: [h for h in dims if h in kept[fam]] for name, dims in spec[section].items()}
                spec[section] = {name: dims for name, dims in cut.items() if dims}
    for table in data["tiles"].values():
        for key, tiles in table.items():
            fam = key.split("_")[0]  # f16_bf16_alibi: the f16 family's
            if isinstance(tiles, dict) and fam in kept:
                for head_dim in [h for h in tiles if isinstance(h, int) and h not in kept[fam]]:
                    del tiles[head_dim]
    for target in data["targets"].values():
        if "head_dims" in target:
            target["head_dims"] = {fam: [h for h in dims if h in kept[fam]] for fam, dims in target["head_dims"].items()}
    directory.mkdir(parents=True, exist_ok=True)
    variants, tuned = directory / "variants.yaml", directory / "tuned"
    variants.write_text(yaml.safe_dump(data, sort_keys=False))
    tuned.mkdir(exist_ok=True)
    return variants, tuned


def write_one_family(directory: Path) -> tuple[Path, Path]:
    """The fp16 family alone at head_dim 64 and GQA group 1, with no other layout, dtype or score
    option: one to three kernels a target, for the tests of paths (quoting, depfiles), not kernels."""
    data = yaml.safe_load(DEFAULT_VARIANTS.read_text())
    data["kernels"] = {"f16": {"head_dims": [64], "gqa_groups": [1]}}
    for table in data["tiles"].values():
        for key in [k for k, tiles in table.items() if isinstance(tiles, dict) and k != "f16"]:
            del table[key]
    for target in data["targets"].values():
        if "head_dims" in target:
            target["head_dims"] = {fam: dims for fam, dims in target["head_dims"].items() if fam == "f16"}
    return write(directory, (64,), yaml.safe_dump(data, sort_keys=False))
