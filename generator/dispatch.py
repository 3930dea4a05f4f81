"""The per-target dispatch table: which kernel serves which call, as sorted JSON data."""

from __future__ import annotations

import json

from .matrix import KernelSpec, Target


def table(target: Target, specs: list[KernelSpec], code_object: str) -> dict:
    entries = []
    for spec in sorted(specs, key=lambda s: (s.kind, s.head_dim, -s.gqa_group)):
        entries.append({
            "name": spec.name,
            "kind": spec.kind,
            "head_dim": spec.head_dim,
            "gqa_group": spec.gqa_group,
            "tier": spec.tier.value,
            "threads": spec.tile.threads,
            "br": spec.tile.br,
            "bc": spec.tile.bc,
            "lds_bytes": spec.lds_bytes,
            # The largest group that divides the call's query heads per K/V head wins.
            "priority": spec.gqa_group,
        })
    data = {"target": target.name, "platform": target.platform, "wave_size": target.wave_size,
            "code_object": code_object, "kernels": entries}
    problems = check(data)
    if problems:
        raise ValueError(f"dispatch table for {target.name}: " + "; ".join(problems))
    return data


def check(data: dict) -> list[str]:
    """Duplicate keys, and (kind, head_dim) pairs with no group-1 kernel to fall back on."""
    seen: set[tuple] = set()
    problems = []
    for e in data["kernels"]:
        key = (e["kind"], e["head_dim"], e["gqa_group"])
        if key in seen:
            problems.append(f"duplicate entry for {key}")
        seen.add(key)
    for kind, hd, _ in sorted(seen):
        if (kind, hd, 1) not in seen:
            problems.append(f"{kind} head_dim {hd} has no gqa_group 1 kernel to fall back on")
    return problems


def dumps(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
