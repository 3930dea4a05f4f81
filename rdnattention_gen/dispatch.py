"""The per-target dispatch table: which kernel serves which call, as sorted JSON data, checked
statically for duplicate and unreachable entries and for keys with no fallback."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rdnattention.dispatch import TABLE_FORMAT

from . import __version__
from .matrix import Target, Variant
from .platforms import platform


def table(target: Target, variants: list[Variant], code_object: Path, dynamic_lds: bool, toolchain: str,
          isa_targets: list[str]) -> dict:
    """The table of one built target; ``code_object`` is the built file, whose size and SHA-256 the
    table records so that the runtime never loads a truncated or replaced one."""
    from .families import family

    entries = []
    for v in variants:
        spec, fam = v.spec, family(v.spec.family)
        entries.append({
            "name": spec.name,
            "family": spec.family,
            "head_dim": spec.head_dim,
            "gqa_group": spec.gqa_group,
            "tier": spec.tier,
            "threads": spec.tile.threads,
            "br": spec.tile.br,
            "bc": spec.tile.bc,
            "tm": spec.tile.tm,
            "lds_bytes": spec.lds_bytes,
            # Within a (family, head_dim) the largest GQA group that divides the call's query heads
            # per K/V head wins, then the highest priority among the entries whose `when` admits it.
            "priority": v.priority,
            "when": v.when.to_json(),
            "provenance": v.provenance,
            "args_digest": fam.args.digest,
        })
    data = {"format": TABLE_FORMAT, "target": target.name, "platform": target.platform,
            "wave_size": target.wave_size, "code_object": code_object.name, "dynamic_lds": dynamic_lds,
            "code_object_bytes": code_object.stat().st_size,
            "code_object_sha256": hashlib.sha256(code_object.read_bytes()).hexdigest(),
            # The ABI the code object is built for (amdgcn; null where the platform pins none).
            "code_object_version": platform(target.platform).code_object_version,
            # Targets of the same instruction set: their GPUs run this code object only when they report
            # this target (HSA_OVERRIDE_GFX_VERSION); the runtime names them when their own are missing.
            "isa": target.isa, "isa_targets": isa_targets,
            "generator_version": __version__, "toolchain": toolchain, "kernels": entries}
    problems = check_entries(variants)
    if problems:
        raise ValueError(f"dispatch table for {target.name}: " + "; ".join(problems))
    return data


def check_entries(variants: list[Variant]) -> list[str]:
    """Entries no call can reach (a higher-priority entry of the same key admits every call they
    admit), entries of equal priority that some call could match both (the choice would depend
    on order), keys without an unconstrained entry, and (family, head_dim) pairs with no group-1
    kernel to fall back on. Alternates (negative priority) serve only calls that name them."""
    problems = []
    keys: dict[tuple, list[Variant]] = {}
    for v in variants:
        if v.priority < 0:  # an alternate: chosen only by name
            continue
        keys.setdefault((v.spec.family, v.spec.head_dim, v.spec.gqa_group), []).append(v)
    for key, entries in sorted(keys.items()):
        for i, v in enumerate(entries):
            for o in entries[i + 1:]:
                if o.priority == v.priority and o.when.overlaps(v.when):
                    problems.append(f"{v.spec.name} ({v.where}) and {o.spec.name} ({o.where}) both serve some calls "
                                    "at the same priority; give them disjoint `when:`")
            for o in entries:
                if o.priority > v.priority and o.when.covers(v.when):
                    problems.append(f"{v.spec.name} ({v.where}) is never chosen: {o.spec.name} ({o.where}) "
                                    "serves every call it would")
                    break
        if not any(not v.when.to_json() for v in entries):
            problems.append(f"{key[0]} head_dim {key[1]} group {key[2]} has no entry without `when:`")
    for fam, hd in sorted({(k[0], k[1]) for k in keys}):
        if (fam, hd, 1) not in keys:
            problems.append(f"{fam} head_dim {hd} has no gqa_group 1 kernel to fall back on")
    return problems


def dumps(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
