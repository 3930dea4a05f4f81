"""The per-target dispatch table: which kernel serves which call, as sorted JSON data, checked
statically for duplicate and unreachable entries and for keys with no fallback."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rdnattention.dispatch import TABLE_FORMAT

from . import __version__
from .families import family
from .matrix import Variant, check_entries
from .platforms import platform
from .target import Target


def table(target: Target, variants: list[Variant], code_object: Path, dynamic_lds: bool, toolchain: str,
          isa_targets: list[str]) -> dict:
    """The table of one built target; ``code_object`` is the built file, whose size and SHA-256 the
    table records so that the runtime never loads a truncated or replaced one."""
    entries = []
    for v in variants:
        spec, fam = v.spec, family(v.spec.family)
        entries.append({
            "name": spec.name,
            "family": spec.family,
            "layout": spec.option("layout"),  # the family's layout option; null: the plain kernels
            "dtype": spec.option("dtype"),  # the family's dtype option; null: fp16
            "score": spec.option("score"),  # the family's score option (alibi); null: none
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
            # The most query rows a split-KV tile applies ALiBi in (the prelude's FA2_DECODE_ALIBI_ROWS).
            "decode_alibi_rows": target.decode_alibi_rows,
            "generator_version": __version__, "toolchain": toolchain, "kernels": entries}
    problems = check_entries(variants)
    if problems:
        raise ValueError(f"dispatch table for {target.name}: " + "; ".join(problems))
    return data


def dumps(data: dict) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
