"""Resource audit of built code objects, read from the AMDGPU metadata note and the disassembly."""

from __future__ import annotations

import re
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from .matrix import TIER_SIGNATURE, KernelSpec, Target
from .toolchain import Toolchain

# Instruction families counted per kernel: audit field -> mnemonic prefix.
COUNTED = {
    "dot2": "v_dot2",
    "dot4": "v_dot4",
    "fma_mix": "v_fma_mix",
    "mad_mix": "v_mad_mix",
    "cvt_f32_f16": "v_cvt_f32_f16",
}


@dataclass(frozen=True)
class KernelAudit:
    target: str
    name: str
    vgprs: int
    sgprs: int
    vgpr_spills: int
    sgpr_spills: int
    scratch_bytes: int
    lds_bytes: int
    wave_size: int
    waves_per_simd: int
    dot2: int
    dot4: int
    fma_mix: int
    mad_mix: int
    cvt_f32_f16: int

    def to_json(self) -> dict:
        return asdict(self)


class AuditError(RuntimeError):
    """A built kernel breaks a resource rule; the message lists every violation."""


def _metadata(toolchain: Toolchain, code_object: Path) -> list[dict]:
    out = subprocess.run([toolchain.readelf, "--notes", str(code_object)],
                         capture_output=True, text=True, check=True).stdout
    start = out.index("---")
    end = out.index("...", start)
    return yaml.safe_load(out[start:end])["amdhsa.kernels"]


_SYMBOL = re.compile(r"^[0-9a-f]+ <(?P<name>[^>]+)>:$")


def _instruction_counts(toolchain: Toolchain, code_object: Path) -> dict[str, dict[str, int]]:
    out = subprocess.run([toolchain.objdump, "-d", "--no-show-raw-insn", str(code_object)],
                         capture_output=True, text=True, check=True).stdout
    counts: dict[str, dict[str, int]] = {}
    current = None
    for line in out.splitlines():
        m = _SYMBOL.match(line)
        if m:
            current = counts.setdefault(m["name"], dict.fromkeys(COUNTED, 0))
            continue
        if current is None:
            continue
        mnemonic = line.strip().split(" ", 1)[0]
        for field, prefix in COUNTED.items():
            if mnemonic.startswith(prefix):
                current[field] += 1
    return counts


def audit_code_object(toolchain: Toolchain, target: Target, specs: list[KernelSpec],
                      code_object: Path) -> list[KernelAudit]:
    meta = {k[".name"]: k for k in _metadata(toolchain, code_object)}
    counts = _instruction_counts(toolchain, code_object)
    rows = []
    for spec in specs:
        k = meta.get(spec.name)
        if k is None:
            raise AuditError(f"{code_object}: kernel {spec.name} is missing from the code object")
        vgprs, lds = k[".vgpr_count"], k[".group_segment_fixed_size"]
        rows.append(KernelAudit(
            target=target.name, name=spec.name, vgprs=vgprs, sgprs=k[".sgpr_count"],
            vgpr_spills=k.get(".vgpr_spill_count", 0), sgpr_spills=k.get(".sgpr_spill_count", 0),
            scratch_bytes=k[".private_segment_fixed_size"], lds_bytes=lds, wave_size=k[".wavefront_size"],
            waves_per_simd=target.waves_per_simd(vgprs, lds, spec.tile.threads),
            **counts.get(spec.name, dict.fromkeys(COUNTED, 0)),
        ))
    return rows


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)'")
_PTXAS_FRAME = re.compile(r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (?P<regs>\d+) registers(?:.*?, (?P<smem>\d+) bytes smem)?")


def audit_cubin(target: Target, specs: list[KernelSpec], cubin: Path, report: Path, ptx: Path) -> list[KernelAudit]:
    """The cuda audit, from ptxas -v (registers, spill bytes, stack, shared memory) and the PTX."""
    info: dict[str, dict[str, int]] = {}
    current = None
    for line in report.read_text().splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current = info.setdefault(m["name"], {"stack": 0, "spills": 0, "regs": 0, "smem": 0})
        elif current is not None and (m := _PTXAS_FRAME.search(line)):
            current["stack"], current["spills"] = int(m["stack"]), int(m["stores"]) + int(m["loads"])
        elif current is not None and (m := _PTXAS_USED.search(line)):
            current["regs"], current["smem"] = int(m["regs"]), int(m["smem"] or 0)
    converts: dict[str, int] = {}
    name = None
    for line in ptx.read_text().splitlines():
        if m := re.match(r"^\.visible \.entry (\w+)\(", line):
            name = m.group(1)
            converts[name] = 0
        elif name is not None and "cvt.f32.f16" in line:
            converts[name] += 1
    rows = []
    for spec in specs:
        k = info.get(spec.name)
        if k is None:
            raise AuditError(f"{report}: no ptxas report for kernel {spec.name}")
        rows.append(KernelAudit(
            target=target.name, name=spec.name, vgprs=k["regs"], sgprs=0, vgpr_spills=k["spills"], sgpr_spills=0,
            # Shared memory is dynamic (sized by the launch), so the layout adds to any static use.
            scratch_bytes=k["stack"], lds_bytes=k["smem"] + spec.lds_bytes, wave_size=target.wave_size,
            waves_per_simd=target.waves_per_simd(k["regs"], k["smem"] + spec.lds_bytes, spec.tile.threads),
            dot2=0, dot4=0, fma_mix=0, mad_mix=0, cvt_f32_f16=converts.get(spec.name, 0)))
    return rows


def violations(target: Target, spec: KernelSpec, row: KernelAudit) -> list[str]:
    out = []
    if row.vgpr_spills or row.sgpr_spills:
        out.append(f"spills {row.vgpr_spills} VGPRs and {row.sgpr_spills} SGPRs")
    if row.scratch_bytes:
        out.append(f"uses {row.scratch_bytes} bytes of scratch")
    if row.lds_bytes > target.lds_bytes:
        out.append(f"uses {row.lds_bytes} bytes of LDS, over the {target.lds_bytes} budget")
    if row.lds_bytes != spec.lds_bytes:
        out.append(f"allocates {row.lds_bytes} bytes of LDS but its layout says {spec.lds_bytes}")
    if row.wave_size != target.wave_size:
        out.append(f"is wave{row.wave_size}, the target runs wave{target.wave_size}")
    signature = TIER_SIGNATURE[spec.tier]
    field = next(f for f, prefix in COUNTED.items() if signature.startswith(prefix))
    if getattr(row, field) == 0:
        out.append(f"tier {spec.tier.value} but no {signature} instruction in the kernel")
    return out


def check(target: Target, specs: list[KernelSpec], rows: list[KernelAudit]) -> None:
    by_name = {s.name: s for s in specs}
    problems = [f"{target.name}/{r.name}: {p}" for r in rows for p in violations(target, by_name[r.name], r)]
    if problems:
        raise AuditError("audit failed:\n  " + "\n  ".join(problems))


COLUMNS = ("target", "name", "vgprs", "sgprs", "vgpr_spills", "scratch_bytes", "lds_bytes",
           "waves_per_simd", "dot2", "dot4", "fma_mix", "mad_mix", "cvt_f32_f16")
HEADERS = ("target", "kernel", "VGPR", "SGPR", "spill", "scratch", "LDS", "waves/SIMD",
           "dot2", "dot4", "fma_mix", "mad_mix", "cvt")


def table(rows: list[KernelAudit]) -> str:
    cells = [HEADERS] + [tuple(str(getattr(r, c)) for c in COLUMNS) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADERS))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
