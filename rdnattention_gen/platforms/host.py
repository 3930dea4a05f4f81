"""host: the CPU emulator. The same kernel sources compiled as plain C++, each GPU thread a fiber
(templates/host/rdna_host.cpp), linked into one shared library per target. The audit checks the
LDS layout: each kernel records its LDS size as the symbol "<kernel>::lds_extent" (see
prelude_host.h.j2), and the emulator gives each workgroup the target's LDS budget."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import ninja

from .. import HOST_DIR, INCLUDE_DIR
from ..kernel_audit import AuditError, KernelAudit
from ..ninja_paths import depfile_safe
from ..platform import Platform
from ..spec import KernelSpec
from ..target import Target
from ..toolchain import Toolchain

HOST_FLAGS = "-O2 -std=c++17 -fno-strict-aliasing -fPIC -Wall -Wno-pass-failed"
# llvm-nm -C -S: address, size, type, demangled name; a kernel's LDS size is "<kernel>::lds_extent".
_LDS_SYMBOL = re.compile(r"^[0-9a-f]+ (?P<size>[0-9a-f]+) [a-zA-Z] (?P<kernel>\w+)::lds_extent$")


def defines(target: Target) -> list[str]:
    """The -D flags of every host compile for ``target``: rdna_host.cpp and the prelude need both."""
    return [f"-DRDNA_WAVE_SIZE={target.wave_size}", f"-DRDNA_LDS_BYTES={target.lds_bytes}"]


class Host(Platform):
    mirrors = True
    name = "host"
    description = "CPU emulation (one fiber per GPU thread) used to test every kernel"
    code_object = "librdnattention_host.so"
    target_prefix = "host"
    target_names = "host or host_<suffix>"
    int8_dots = ("exact", "none")
    instructions: dict[str, str] = {}  # x86 instructions say nothing about a GPU tier

    def ninja_rules(self, w: ninja.Writer) -> None:
        w.rule("host_cc", description="C++ $target $in", depfile="$out.d", deps="gcc",
               command=f"$clang --driver-mode=g++ {HOST_FLAGS} $defines -I$inc_dir -I$host_inc_dir "
                       "-MD -MF $out.d -c $in -o $out")
        w.rule("host_link", description="LINK $out",
               command="$clang --driver-mode=g++ -shared -fPIC $in -o $out -lpthread")

    def ninja_build(self, w: ninja.Writer, target: Target, specs: list[KernelSpec], gen_dir: Path,
                    out_dir: Path, stamp: str, headers: list[str]) -> None:
        objs = [str(out_dir / "kernels.o"), str(out_dir / "rdna_host.o")]
        variables = {"target": target.name, "defines": " ".join(defines(target))}
        implicit = [stamp]
        if not depfile_safe(gen_dir, out_dir, INCLUDE_DIR, HOST_DIR):
            # Ninja could not read the depfile back; the headers are listed as the device rules do.
            variables.update(depfile="", deps="")
            implicit += headers + sorted(str(p) for p in HOST_DIR.glob("*.h"))
        for obj, src in zip(objs, [gen_dir / "kernels.cpp", HOST_DIR / "rdna_host.cpp"]):
            w.build(obj, "host_cc", str(src), implicit=implicit, variables=variables)
        w.build(str(out_dir / self.code_object), "host_link", objs)

    def audit(self, tc: Toolchain, target: Target, specs: list[KernelSpec], build_dir: Path) -> list[KernelAudit]:
        obj = build_dir / target.name / "kernels.o"
        out = subprocess.run([tc.nm, "-C", "-S", str(obj)], capture_output=True, text=True, check=True).stdout
        lds = {m["kernel"]: int(m["size"], 16) for m in map(_LDS_SYMBOL.match, out.splitlines()) if m}
        rows = []
        for spec in specs:
            if spec.name not in lds and spec.lds_bytes:  # a kernel whose layout has no LDS declares none
                raise AuditError(f"{obj}: no LDS symbol {spec.name}::lds_extent (kernels declare their LDS with RDNA_LDS "
                                 "in the kernel function)")
            rows.append(KernelAudit(
                target=target.name, name=spec.name, vgprs=None, sgprs=None, vgpr_spills=0, sgpr_spills=0,
                scratch_bytes=0, lds_bytes=lds.get(spec.name, 0), wave_size=target.wave_size, waves_per_simd=None,
                dot2=0, dot4=0, fma_mix=0, mad_mix=0, cvt_f32_f16=0))
        return rows


PLATFORM = Host()
