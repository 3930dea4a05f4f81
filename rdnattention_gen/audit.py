"""The resource audit: one row per built kernel, read by the target's platform (metadata notes and
disassembly on amdgcn, ptxas -v and the PTX on cuda, symbol sizes on host), and the rules every
build enforces on it, the platform's launch ABI included (amdgcn: launch_abi.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .matrix import Target
from .spec import KernelSpec

# Instruction counts an audit row carries (zero where a platform does not count them).
COUNTS = ("dot2", "dot4", "fma_mix", "mad_mix", "cvt_f32_f16")


@dataclass(frozen=True)
class KernelAudit:
    target: str
    name: str
    vgprs: int | None        # None: not a GPU register file (host)
    sgprs: int | None
    vgpr_spills: int
    sgpr_spills: int
    scratch_bytes: int
    lds_bytes: int
    wave_size: int
    waves_per_simd: int | None
    dot2: int
    dot4: int
    fma_mix: int
    mad_mix: int
    cvt_f32_f16: int
    # The cost model (cost.py), where the platform reads loops (amdgcn): the main loop's counts per
    # wave and key tile, the bound they imply at this occupancy, and the share of the product peak.
    loop: dict | None = None
    bound: str | None = None
    peak_share: float | None = None
    # What the code object says a dispatch must provide (amdgcn: launch_abi.facts), checked against
    # what the runtime passes; None where the platform does not read it.
    launch: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


class AuditError(RuntimeError):
    """A built kernel breaks a resource rule; the message lists every violation."""


def violations(target: Target, spec: KernelSpec, row: KernelAudit) -> list[str]:
    from .families import family
    from .platforms import platform

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


COLUMNS = ("target", "name", "vgprs", "sgprs", "vgpr_spills", "scratch_bytes", "lds_bytes",
           "waves_per_simd") + COUNTS + ("bound", "peak_share")
HEADERS = ("target", "kernel", "VGPR", "SGPR", "spill", "scratch", "LDS", "waves/SIMD",
           "dot2", "dot4", "fma_mix", "mad_mix", "cvt", "bound (cost model)", "share")


def _cell(row: KernelAudit, column: str) -> str:
    value = getattr(row, column)
    if value is None:
        return "-"
    return f"{value:.0%}" if column == "peak_share" else str(value)


def table(rows: list[KernelAudit]) -> str:
    cells = [HEADERS] + [tuple(_cell(r, c) for c in COLUMNS) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADERS))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
