"""amdgcn: HSA code objects for AMD GPUs, compiled by clang as device-only HIP with builtins only;
audited from the AMDGPU metadata note (llvm-readelf) and the disassembly (llvm-objdump)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import ninja
import yaml

from .. import cost
from ..audit import COUNTS, AuditError, KernelAudit
from ..matrix import Target
from ..platform import DEVICE_FLAGS, Platform
from ..spec import KernelSpec
from ..strict_yaml import Node
from ..toolchain import Toolchain

# Audit count -> mnemonic prefix in the disassembly.
MNEMONICS = {
    "dot2": "v_dot2",
    "dot4": "v_dot4",
    "fma_mix": "v_fma_mix",
    "mad_mix": "v_mad_mix",
    "cvt_f32_f16": "v_cvt_f32_f16",
}
_SYMBOL = re.compile(r"^[0-9a-f]+ <(?P<name>[^>]+)>:$")
# "\tmnemonic operands   // ADDRESS: WORDS [<symbol+0xOFFSET>]"
_LINE = re.compile(r"^\s+(?P<text>\S.*?)\s*// (?P<addr>[0-9A-F]+):[^<]*(?:<(?P<sym>[^>+]+)\+0x(?P<off>[0-9a-f]+)>)?\s*$")
# e_ident[EI_ABIVERSION] of an HSA code object, by code object version (LLVM's ELF.h:
# ELFABIVERSION_AMDGPU_HSA_V4 = 2, _V5 = 3, _V6 = 4).
_ELFOSABI_AMDGPU_HSA = 64
_ELF_ABI_VERSION = {4: 2, 5: 3, 6: 4}


class Amdgcn(Platform):
    name = "amdgcn"
    description = "HSA code objects for AMD GPUs, one per gfx target"
    code_object = "kernels.hsaco"
    target_prefix = "gfx"
    target_names = "gfxNNN[N]"
    int8_dots = ("sdot4", "sudot4", "none")
    instructions = {"dot2": "v_dot2", "dot4": "v_dot4", "fma_mix": "v_fma_mix_f32", "mad_mix": "v_mad_mix_f32",
                    "cvt_f32_f16": "v_cvt_f32_f16"}
    # Pinned below clang 22's default (v6), which ROCm loaders accept only from 6.2 on and which adds
    # nothing a per-gfx build uses (generic targets); every ROCm since 5.2 loads v5. The sources are
    # in docs/hardware.md, "Code objects".
    code_object_version = 5
    # 2: both operations of an RDNA3 dual-issue word are counted; 3: code object version checked;
    # 4: the main loop's counts and the cost model's estimate
    audit_version = 5  # 5: the loop analysis weights only the loops that carry the products

    def validate_target(self, name: str, fields: dict, node: Node) -> None:
        super().validate_target(name, fields, node)
        if fields["hw_tier"] == 1 and not fields["fdot2"]:
            raise node.fail("hw_tier", "tier 1 needs fdot2: true")
        if fields["hw_tier"] == 2 and fields["int8_dot"] != "none":
            raise node.fail("hw_tier", "tier 2 targets have no int8 dot instruction (int8_dot: none)")

    def ninja_rules(self, w: ninja.Writer) -> None:
        # Device-only HIP compiles write no depfile, so every header is listed as an input instead.
        w.rule("amdgcn", description="HIP $target ($kernels kernels)",
               command="$clang -x hip --offload-device-only -nogpuinc -nogpulib --no-gpu-bundle-output "
                       f"--offload-arch=$target -mcode-object-version={self.code_object_version} {DEVICE_FLAGS} "
                       "-I$inc_dir $in -o $out")

    def ninja_build(self, w: ninja.Writer, target: Target, specs: list[KernelSpec], gen_dir: Path,
                    out_dir: Path, stamp: str, headers: list[str]) -> None:
        w.build(str(out_dir / self.code_object), "amdgcn", str(gen_dir / "kernels.cpp"), implicit=[stamp] + headers,
                variables={"target": target.name, "kernels": str(len(specs))})

    def audit(self, tc: Toolchain, target: Target, specs: list[KernelSpec], build_dir: Path) -> list[KernelAudit]:
        code_object = self.code_object_path(target, build_dir)
        _check_code_object_version(code_object, self.code_object_version)
        from ..families import family

        meta = {k[".name"]: k for k in _metadata(tc, code_object)}
        counts, code = _disassembly(tc, code_object)
        rows = []
        for spec in specs:
            k = meta.get(spec.name)
            if k is None:
                raise AuditError(f"{code_object}: kernel {spec.name} is missing from the code object")
            vgprs, lds = k[".vgpr_count"], k[".group_segment_fixed_size"]
            waves = target.waves_per_simd(vgprs, lds, spec.tile.threads)
            fam = family(spec.family)
            product = MNEMONICS.get(fam.signatures.get(spec.tier, ""))
            loop = cost.loop_counts(code.get(spec.name, []), product, fam.products_per_step(spec)) if product else None
            rows.append(KernelAudit(
                target=target.name, name=spec.name, vgprs=vgprs, sgprs=k[".sgpr_count"],
                vgpr_spills=k.get(".vgpr_spill_count", 0), sgpr_spills=k.get(".sgpr_spill_count", 0),
                scratch_bytes=k[".private_segment_fixed_size"], lds_bytes=lds, wave_size=k[".wavefront_size"],
                waves_per_simd=waves,
                **counts.get(spec.name, dict.fromkeys(COUNTS, 0)),
                **cost.audit_fields(loop, target, waves),
            ))
        return rows


def _check_code_object_version(code_object: Path, version: int) -> None:
    """The ELF header says ``version``: a runtime older than the version a code object is built for
    refuses to load it, so a compiler that ignored the flag must fail the build, not the user."""
    with code_object.open("rb") as f:
        ident = f.read(16)
    if ident[:4] != b"\x7fELF" or ident[7] != _ELFOSABI_AMDGPU_HSA:
        raise AuditError(f"{code_object}: not an AMDGPU HSA code object (ELF ident {ident.hex()})")
    expected = _ELF_ABI_VERSION[version]
    if ident[8] != expected:
        found = {abi: v for v, abi in _ELF_ABI_VERSION.items()}.get(ident[8])
        raise AuditError(f"{code_object}: ELF ABI version {ident[8]} (code object "
                         f"{f'v{found}' if found else 'version unknown'}), expected {expected} (code object "
                         f"v{version}, -mcode-object-version={version})")


def _metadata(tc: Toolchain, code_object: Path) -> list[dict]:
    out = subprocess.run([tc.readelf, "--notes", str(code_object)], capture_output=True, text=True, check=True).stdout
    start = out.index("---")
    end = out.index("...", start)
    return yaml.safe_load(out[start:end])["amdhsa.kernels"]


def _disassembly(tc: Toolchain, code_object: Path) -> tuple[dict[str, dict[str, int]],
                                                          dict[str, list[cost.Instruction]]]:
    """Per kernel: the audit's instruction counts, and its instructions for the cost model."""
    out = subprocess.run([tc.objdump, "-d", "--no-show-raw-insn", str(code_object)],
                         capture_output=True, text=True, check=True).stdout
    counts: dict[str, dict[str, int]] = {}
    code: dict[str, list[cost.Instruction]] = {}
    current = None
    for line in out.splitlines():
        m = _SYMBOL.match(line)
        if m:
            current = counts.setdefault(m["name"], dict.fromkeys(COUNTS, 0))
            listing = code.setdefault(m["name"], [])
            start = int(line.split()[0], 16)
            continue
        if current is None:
            continue
        parsed = _LINE.match(line)
        # An RDNA3 dual-issue (VOPD) word holds two operations: "v_dual_X ... :: v_dual_Y ...".
        for op in (parsed["text"] if parsed else line).split("::"):
            mnemonic, _, operands = op.strip().partition(" ")
            if mnemonic.startswith("v_dual_"):
                mnemonic = "v_" + mnemonic[len("v_dual_"):]
            for field, prefix in MNEMONICS.items():
                if mnemonic.startswith(prefix):
                    current[field] += 1
            if parsed:
                target = start + int(parsed["off"], 16) if parsed["off"] and mnemonic.startswith(("s_branch", "s_cbranch")) else None
                listing.append(cost.Instruction(int(parsed["addr"], 16), mnemonic, operands.strip(), target))
    return counts, code


PLATFORM = Amdgcn()
