"""The resource audit's rows: one per built kernel, as the target's platform reads it (metadata
notes and disassembly on amdgcn, ptxas -v and the PTX on cuda, symbol sizes on host), the error a
kernel that breaks a rule raises, and the table the CLI prints. The rules are audit.py's."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
