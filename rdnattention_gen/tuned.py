"""Tuned overlays: ``tuned/<target>.yaml``, written by a tuner run on the target's GPU. Each entry
is a tile measured better for (family, head_dim[, gqa_group][, when]) with what it was measured
on; the matrix merges them over the tile tables and the dispatch table prefers them.

    target: sm_90
    entries:
      - family: f16
        head_dim: 128
        when: {causal: true}                 # optional: only these calls
        tile: {br: 64, bc: 64, threads: 128, tm: 8}
        measured:
          device: NVIDIA H200
          toolchain: clang version 22.0.0
          date: 2026-11-29
          figures: {tflops: 18.63, baseline_tflops: 17.19}
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from rdnattention.table import Constraints

from .spec import Tile
from .strict_yaml import Node, VariantsError, load
from .when import constraints


@dataclass(frozen=True)
class TunedEntry:
    family: str
    head_dim: int
    gqa_group: int | None  # None: every group of the family
    tile: Tile
    when: Constraints
    measured: dict
    where: str       # file:line: entries[i], for error messages
    provenance: str  # tuned/<target>.yaml


def _measured(node: Node) -> dict:
    date = node.take("date", (str, datetime.date))
    figures = node.child("figures")
    values = {}
    for key in sorted(figures, key=lambda k: figures.key_lines[k]):
        value = figures.take(key, (int, float))
        values[key] = value
    figures.finish()
    out = {"device": node.take("device", str), "toolchain": node.take("toolchain", str),
           "date": str(date), "figures": values}
    for key in ("clocks", "command"):  # optional: what the tuner records
        if key in node:
            out[key] = node.take(key, str)
    if "candidates" in node:  # every tile timed for the entry: label -> figure
        cands = node.child("candidates")
        out["candidates"] = {k: cands.take(k, (int, float)) for k in sorted(cands, key=lambda k: cands.key_lines[k])}
        cands.finish()
    node.finish()
    return out


def load_tuned(path: Path, targets: set[str], kernels: dict[str, dict]) -> tuple[str, tuple[TunedEntry, ...]]:
    """Reads one overlay strictly; returns (target, entries)."""
    root = load(path, display_name=f"tuned/{path.name}")
    target = root.take("target", str)
    if target != path.stem:
        raise root.fail("target", f"{target!r} does not match the file name {path.name}")
    if target not in targets:
        raise root.fail("target", f"{target!r} is not a target in variants.yaml")
    items = root.take("entries", list)
    entries = []
    for i, item in enumerate(items):
        if not isinstance(item, Node):
            raise root.fail("entries", f"entry {i} must be a mapping")
        family = item.choice("family", tuple(sorted(kernels)))
        head_dim = item.take("head_dim", int)
        if head_dim not in kernels[family]["head_dims"]:
            raise item.fail("head_dim", f"{head_dim} is not one of {family}'s head_dims "
                                        f"{list(kernels[family]['head_dims'])}")
        group = item.take("gqa_group", int, None)
        if group is not None and group not in kernels[family]["gqa_groups"]:
            raise item.fail("gqa_group", f"{group} is not one of {family}'s gqa_groups "
                                         f"{list(kernels[family]['gqa_groups'])}")
        tile_node = item.child("tile")
        tile = Tile(**{k: tile_node.take(k, int) for k in ("br", "bc", "threads", "tm")},
                    waves=tile_node.take("waves", int, 0))
        tile_node.finish()
        when = constraints(item.child("when")) if "when" in item else Constraints()
        measured = _measured(item.child("measured"))
        item.finish()
        entries.append(TunedEntry(family=family, head_dim=head_dim, gqa_group=group, tile=tile, when=when,
                                  measured=measured, where=f"{item.file}:{item.line}: entries[{i}]",
                                  provenance=f"tuned/{path.name}"))
    root.finish()
    keys = [(e.family, e.head_dim, e.gqa_group, e.when) for e in entries]
    for i, key in enumerate(keys):
        if key in keys[:i]:
            raise VariantsError(f"{entries[i].where}: same family, head_dim, gqa_group and when as "
                                f"entries[{keys.index(key)}]")
    return target, tuple(entries)
