"""The resource audit's rules, which every build enforces on the rows the target's platform reads
(kernel_audit.py), the platform's launch ABI included (amdgcn: launch_abi.py)."""

from __future__ import annotations

from .families import family
from .kernel_audit import AuditError, KernelAudit
from .platforms import platform
from .spec import KernelSpec
from .target import Target


def violations(target: Target, spec: KernelSpec, row: KernelAudit) -> list[str]:
    plat = platform(target.platform)
    out = []
    if row.vgpr_spills or row.sgpr_spills:
        out.append(f"spills {row.vgpr_spills} VGPRs and {row.sgpr_spills} SGPRs")
    if row.scratch_bytes:
        out.append(f"uses {row.scratch_bytes} bytes of scratch")
    if row.lds_bytes > target.lds_bytes:
        out.append(f"uses {row.lds_bytes} bytes of LDS, over the {target.lds_bytes} budget")
    layout = spec.lds_bytes
    if row.lds_bytes != layout:
        out.append(f"allocates {row.lds_bytes} bytes of LDS but its layout says {layout}")
    if row.wave_size != target.wave_size:
        out.append(f"is wave{row.wave_size}, the target runs wave{target.wave_size}")
    field = family(spec.family).signatures[spec.tier]
    if field in plat.instructions and getattr(row, field) == 0:
        out.append(f"tier {spec.tier} but no {plat.instructions[field]} instruction in the kernel")
    return out + plat.launch_violations(target, spec, row)


def check(target: Target, specs: list[KernelSpec], rows: list[KernelAudit]) -> None:
    by_name = {s.name: s for s in specs}
    problems = [f"{target.name}/{r.name}: {p}" for r in rows for p in violations(target, by_name[r.name], r)]
    if problems:
        raise AuditError("audit failed:\n  " + "\n  ".join(problems))
