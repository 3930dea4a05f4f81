"""docs/hardware.md, generated from the matrix and the audit."""

from __future__ import annotations

from .audit import COUNTED, KernelAudit
from .matrix import TIER_SIGNATURE, Matrix, Tier
from .render import environment


def hardware_md(matrix: Matrix, rows: list[KernelAudit], compiler: str) -> str:
    tiers = []
    for tier in Tier:
        names = [f"`{t.name}`" for t in matrix.targets if t.tier == tier]
        tiers.append((tier.value, TIER_SIGNATURE[tier], ", ".join(names) or "none"))
    table = []
    for r in rows:
        target = matrix.target(r.target)
        sig = "cvt.f32.f16" if target.platform == "cuda" else TIER_SIGNATURE[target.tier]
        field = "cvt_f32_f16" if target.platform == "cuda" else next(
            f for f, prefix in COUNTED.items() if sig.startswith(prefix))
        table.append({**r.to_json(), "signature": f"{getattr(r, field)} × `{sig}`"})
    return environment().get_template("docs/hardware.md.j2").render(
        tiers=tiers, targets=matrix.targets, rows=table, compiler=compiler)
