"""docs/hardware.md, generated from the matrix and the audit."""

from __future__ import annotations

from rdnattention.dispatch import rocm_floor

from . import packaging
from .families import FAMILIES, family, spec_from_name
from .kernel_audit import KernelAudit
from .matrix import Matrix
from .platforms import PLATFORMS, platform
from .platforms.amdgcn import ELF_ABI_VERSION
from .render import environment
from .target import Tier


class DocsError(ValueError):
    """A docs command asked for something it cannot do."""


def hardware_md(matrix: Matrix, rows: list[KernelAudit], compiler: str, inputs: dict[str, str]) -> str:
    """The page, from the matrix, the audit ``rows`` of every GPU target, the ``compiler`` they
    were built with and each target's build.audit_inputs digest."""
    amdgcn = PLATFORMS["amdgcn"].instructions
    fp16 = FAMILIES["f16"].signatures
    tiers = []
    for tier in Tier:
        names = [f"`{t.name}`" for t in matrix.targets if t.tier == tier]
        tiers.append((tier.value, amdgcn[fp16[tier.value]], ", ".join(names) or "none"))
    # Targets of one instruction set whose rows are their set's first target's (what assembling from
    # one compile gives, build.py) are listed in that target's rows.
    per_target: dict[str, list[dict]] = {}
    for r in rows:
        per_target.setdefault(r.target, []).append({k: v for k, v in r.to_json().items() if k != "target"})
    listed_with: dict[str, list[str]] = {}
    for name, own in per_target.items():
        isa = matrix.target(name).isa
        if isa != name and per_target.get(isa) == own:
            listed_with.setdefault(isa, []).append(name)
    folded = {name for names in listed_with.values() for name in names}
    table = []
    for r in rows:
        if r.target in folded:
            continue
        target = matrix.target(r.target)
        plat = platform(target.platform)
        spec = spec_from_name(r.name)
        field = family(spec.family).signatures[spec.tier]
        sig = f"{getattr(r, field)} × `{plat.instructions[field]}`" if field in plat.instructions else "-"
        share = f"{r.peak_share:.0%}" if r.peak_share is not None else "-"
        label = ", ".join(f"`{n}`" for n in [r.target, *listed_with.get(r.target, ())])
        table.append({**r.to_json(), "label": label, "signature": sig, "share": share})
    tile_tables, tile_rows = [], []
    for name, t in matrix.tile_tables.items():
        users = ", ".join(f"`{x.name}`" for x in matrix.targets if x.tiles == name) or "(inherited only)"
        tile_tables.append({"name": name, "inherit": f"`{t.inherit}`" if t.inherit else "-", "targets": users})
        for fam, per in t.choices.items():
            for key in sorted(per, key=lambda k: (k != "default", k if k != "default" else 0)):
                for c in per[key]:
                    tile_rows.append({"table": name, "family": fam, "head_dim": key,
                                      "tile": f"{c.tile.br} × {c.tile.bc}, {c.tile.threads}, {c.tile.tm}"
                                              + (f", {c.tile.waves}" if c.tile.waves else ""),
                                      "when": str(c.when) if c.when.to_json() else "-"})
    distribution = {name: f"`{dist}`" for dist, names in packaging.distributions(matrix).items()
                    for name in names.split(", ")}
    tuned = "; ".join(f"`{target}`: {len(entries)} entries" for target, entries in sorted(matrix.tuned.items()))
    mirrors = "; ".join(f"`{t.name}` mirrors {', '.join(f'`{m}`' for m in t.mirrors)}" for t in matrix.targets
                        if t.mirrors) or "none"
    version = PLATFORMS["amdgcn"].code_object_version
    return environment().get_template("docs/hardware.md.j2").render(
        code_object_version=version, elf_abi_version=ELF_ABI_VERSION[version], rocm_floor=rocm_floor(version),
        tiers=tiers, targets=matrix.targets,
        bf16_dot_targets=", ".join(f"`{t.name}`" for t in matrix.targets if t.bf16_dot) or "none", distribution=distribution, rows=table, compiler=compiler, tile_tables=tile_tables, tile_rows=tile_rows,
        tuned=tuned or "none yet (a tuner run on the GPU writes them)", mirrors=mirrors,
        inputs=inputs)


AUDIT_HEADING = "## Kernel resources (audit)"


def without_audit_rows(text: str, targets: set[str]) -> str:
    """``text`` (a hardware.md) without the audit table's rows of ``targets``: those whose label
    starts with one of them (a label lists the targets of one compile, its compiled one first)."""
    lines = text.split("\n")
    start = lines.index(AUDIT_HEADING) if AUDIT_HEADING in lines else len(lines)
    kept = lines[:start]
    for i, line in enumerate(lines[start:], start):
        if i > start and line.startswith("## "):
            kept += lines[i:]
            break
        if line.startswith("| `") and line[3:].split("`", 1)[0] in targets:
            continue
        kept.append(line)
    return "\n".join(kept)
