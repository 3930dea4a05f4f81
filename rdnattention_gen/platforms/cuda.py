"""cuda: cubins for NVIDIA GPUs. clang compiles the kernels to PTX with builtins only, ptxas
assembles them; audited from ptxas -v (registers, spills, stack, shared memory) and the PTX."""

from __future__ import annotations

import re
from pathlib import Path

import ninja

from .. import toolchain
from ..kernel_audit import AuditError, KernelAudit
from ..ninja_paths import command_path
from ..platform import DEVICE_FLAGS, Platform
from ..spec import KernelSpec
from ..target import Target
from ..toolchain import Toolchain

_PTXAS_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)'")
_PTXAS_FRAME = re.compile(r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, "
                          r"(?P<loads>\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (?P<regs>\d+) registers(?:.*?, (?P<smem>\d+) bytes smem)?")
_PTX_ENTRY = re.compile(r"^\.visible \.entry (\w+)\(")
# Audit count -> the PTX instruction counted for it.
PTX_INSTRUCTIONS = {"cvt_f32_f16": "cvt.f32.f16", "dot4": "dp4a."}


class Cuda(Platform):
    name = "cuda"
    description = "cubins for NVIDIA GPUs (clang emits PTX, ptxas assembles it)"
    code_object = "kernels.cubin"
    target_prefix = "sm_"
    target_names = "sm_NN"
    dynamic_lds = True
    int8_dots = ("dp4a", "none")
    instructions = {"cvt_f32_f16": "cvt.f32.f16", "dot4": "dp4a"}
    chained = True  # ptxas after clang, each minutes at sm_90

    def unavailable(self, target: Target) -> str | None:
        try:
            toolchain.find_ptxas(target.name)
        except toolchain.ToolchainError as e:
            return str(e)
        return None

    def ninja_rules(self, w: ninja.Writer) -> None:
        w.rule("cuda_ptx", description="CUDA $target ($kernels kernels)",
               command="$clang -x cuda --cuda-device-only -nocudainc -nocudalib -Wno-unknown-cuda-version "
                       f"--cuda-gpu-arch=$target -S {DEVICE_FLAGS} -I$inc_dir $in -o $out")
        # ptxas -v is the resource report the audit reads; it is kept beside the cubin.
        w.rule("cuda_cubin", description="PTXAS $target",
               command="$ptxas -arch=$target -v $in -o $out > $out.ptxas.txt 2>&1 || (cat $out.ptxas.txt; exit 1)")

    def ninja_build(self, w: ninja.Writer, target: Target, specs: list[KernelSpec], gen_dir: Path,
                    out_dir: Path, stamp: str, headers: list[str]) -> None:
        ptx = str(out_dir / "kernels.ptx")
        w.build(ptx, "cuda_ptx", str(gen_dir / "kernels.cpp"), implicit=[stamp] + headers,
                variables={"target": target.name, "kernels": str(len(specs))})
        w.build(str(out_dir / self.code_object), "cuda_cubin", ptx,
                variables={"target": target.name, "ptxas": command_path(toolchain.find_ptxas(target.name))})

    def audit(self, tc: Toolchain, target: Target, specs: list[KernelSpec], build_dir: Path) -> list[KernelAudit]:
        cubin = self.code_object_path(target, build_dir)
        report, ptx = Path(f"{cubin}.ptxas.txt"), cubin.with_suffix(".ptx")
        info: dict[str, dict[str, int]] = {}
        current = None
        for line in report.read_text().splitlines():
            if m := _PTXAS_ENTRY.search(line):
                current = info.setdefault(m["name"], {"stack": 0, "spills": 0, "regs": 0, "smem": 0})
            elif current is not None and (m := _PTXAS_FRAME.search(line)):
                current["stack"], current["spills"] = int(m["stack"]), int(m["stores"]) + int(m["loads"])
            elif current is not None and (m := _PTXAS_USED.search(line)):
                current["regs"], current["smem"] = int(m["regs"]), int(m["smem"] or 0)
        counts: dict[str, dict[str, int]] = {}
        name = None
        for line in ptx.read_text().splitlines():
            if m := _PTX_ENTRY.match(line):
                name = m.group(1)
                counts[name] = dict.fromkeys(PTX_INSTRUCTIONS, 0)
            elif name is not None:
                for field, instruction in PTX_INSTRUCTIONS.items():
                    counts[name][field] += instruction in line
        rows = []
        for spec in specs:
            k = info.get(spec.name)
            if k is None:
                raise AuditError(f"{report}: no ptxas report for kernel {spec.name}")
            # Shared memory is dynamic (sized by the launch), so the layout adds to any static use.
            lds = k["smem"] + spec.lds_bytes
            c = counts.get(spec.name, dict.fromkeys(PTX_INSTRUCTIONS, 0))
            rows.append(KernelAudit(
                target=target.name, name=spec.name, vgprs=k["regs"], sgprs=0, vgpr_spills=k["spills"], sgpr_spills=0,
                scratch_bytes=k["stack"], lds_bytes=lds, wave_size=target.wave_size,
                waves_per_simd=target.waves_per_simd(k["regs"], lds, spec.tile.threads),
                dot2=0, dot4=c["dot4"], fma_mix=0, mad_mix=0, cvt_f32_f16=c["cvt_f32_f16"]))
        return rows


PLATFORM = Cuda()
