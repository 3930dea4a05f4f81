"""amdgcn: HSA code objects for AMD GPUs, compiled by clang as device-only HIP with builtins only;
audited from the AMDGPU metadata note and kernel descriptors (hsaco.py: resources and the launch
ABI, launch_abi.py), the disassembly (llvm-objdump) and, where the machine has one, ROCm's code
object manager (comgr.py: the ISA HIP would load it for)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import ninja

from .. import comgr, cost, launch_abi
from ..families import family
from ..hsaco import CodeObject, CodeObjectError
from ..kernel_audit import COUNTS, AuditError, KernelAudit
from ..platform import DEVICE_FLAGS, Platform
from ..spec import KernelSpec
from ..strict_yaml import Node
from ..target import Target
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
ELF_ABI_VERSION = {4: 2, 5: 3, 6: 4}


class Amdgcn(Platform):
    name = "amdgcn"
    description = "HSA code objects for AMD GPUs, one per gfx target"
    code_object = "kernels.hsaco"
    target_prefix = "gfx"
    target_names = "gfxNNN[N]"
    int8_dots = ("sdot4", "sudot4", "none")
    instructions = {"dot2": "v_dot2", "dot4": "v_dot4", "fma_mix": "v_fma_mix_f32", "mad_mix": "v_mad_mix_f32",
                    "cvt_f32_f16": "v_cvt_f32_f16"}
    # v4: the oldest version clang 22 still writes (it refuses 3), loaded by every ROCm from 4.1 on,
    # so by every ROCm that a supported torch ships with. v5 needs ROCm 5.3: hipModuleLoadData asks
    # comgr for the ISA first, and comgr 5.2.3 (Debian 12) returns status 2 for every v5 object we
    # built, while it names the v4 build of the same sources. The kernels do not change: every
    # target's .text is byte-identical at v4 and v5 (gfx1030's at v6 for gfx10-3-generic too), and
    # no version gives our kernels hidden arguments. v6 needs ROCm 6.2. Floors:
    # rdnattention.dispatch.ROCM_LOADS; sources and measurements: docs/hardware.md, "Code objects".
    code_object_version = 4
    # 2: both operations of an RDNA3 dual-issue word are counted; 3: code object version checked;
    # 4: the main loop's counts and the cost model's estimate; 5: the loop analysis weights only
    # the loops that carry the products
    audit_version = 6  # 6: metadata and descriptors read by hsaco.py; the launch ABI; comgr's ISA name

    def validate_target(self, name: str, fields: dict, node: Node) -> None:
        super().validate_target(name, fields, node)
        if fields["hw_tier"] == 1 and not fields["fdot2"]:
            raise node.fail("hw_tier", "tier 1 needs fdot2: true")
        if fields["hw_tier"] == 2 and fields["int8_dot"] != "none":
            raise node.fail("hw_tier", "tier 2 targets have no int8 dot instruction (int8_dot: none)")

    # Targets of one instruction set with the same sources compile once, to assembly, and assemble
    # their code objects from it (assemble.py): gfx1030-gfx1036 are one compile, not seven.
    shares_compiles = True

    def ninja_rules(self, w: ninja.Writer) -> None:
        # Device-only HIP compiles write no depfile, so every header is listed as an input instead.
        compile_ = ("$clang -x hip --offload-device-only -nogpuinc -nogpulib --no-gpu-bundle-output "
                    f"--offload-arch=$target -mcode-object-version={self.code_object_version} {DEVICE_FLAGS} "
                    "-I$inc_dir $in -o $out")
        w.rule("amdgcn", description="HIP $target ($kernels kernels)", command=compile_)
        w.rule("amdgcn_asm", description="HIP $target ($kernels kernels, to assembly for $shared)",
               command=compile_.replace(" $in -o", " -S $in -o"))
        w.rule("amdgcn_assemble", description="assemble $target (from $source's compile)",
               command="$python -m rdnattention_gen.assemble --clang $clang --source $source --target $target "
                       f"--code-object-version {self.code_object_version} $in $out")

    def ninja_build(self, w: ninja.Writer, target: Target, specs: list[KernelSpec], gen_dir: Path,
                    out_dir: Path, stamp: str, headers: list[str], source: Target | None = None,
                    shared: tuple[str, ...] = ()) -> None:
        out = str(out_dir / self.code_object)
        if source is None:
            w.build(out, "amdgcn", str(gen_dir / "kernels.cpp"), implicit=[stamp] + headers,
                    variables={"target": target.name, "kernels": str(len(specs))})
            return
        assembly = str(out_dir.parent / source.name / "kernels.s")
        if source is target:
            w.build(assembly, "amdgcn_asm", str(gen_dir / "kernels.cpp"), implicit=[stamp] + headers,
                    variables={"target": target.name, "kernels": str(len(specs)), "shared": ", ".join(shared)})
        w.build(out, "amdgcn_assemble", assembly, implicit=[stamp, str(Path(__file__).parents[1] / "assemble.py")],
                variables={"target": target.name, "source": source.name})

    def audit(self, tc: Toolchain, target: Target, specs: list[KernelSpec], build_dir: Path) -> list[KernelAudit]:
        code_object = self.code_object_path(target, build_dir)
        _check_code_object_version(code_object, self.code_object_version)
        try:
            co = CodeObject.read(code_object)
            meta = co.kernels
            launch = {s.name: launch_abi.facts(co, s.name) for s in specs if s.name in meta}
        except CodeObjectError as e:
            raise AuditError(str(e)) from None
        _check_isa_name(co, target)
        machine = _machine_code(tc, target, co, code_object)
        rows = []
        for spec in specs:
            k = meta.get(spec.name)
            if k is None:
                raise AuditError(f"{code_object}: kernel {spec.name} is missing from the code object")
            vgprs, lds = k[".vgpr_count"], k[".group_segment_fixed_size"]
            waves = target.waves_per_simd(vgprs, lds, spec.tile.threads)
            fam = family(spec.family)
            product = MNEMONICS.get(fam.signatures.get(spec.tier, ""))
            loop = machine.loop(spec.name, product, fam.products_per_step(spec)) if product else None
            rows.append(KernelAudit(
                target=target.name, name=spec.name, vgprs=vgprs, sgprs=k[".sgpr_count"],
                vgpr_spills=k.get(".vgpr_spill_count", 0), sgpr_spills=k.get(".sgpr_spill_count", 0),
                scratch_bytes=k[".private_segment_fixed_size"], lds_bytes=lds, wave_size=k[".wavefront_size"],
                waves_per_simd=waves,
                **machine.counts.get(spec.name, dict.fromkeys(COUNTS, 0)),
                **cost.audit_fields(loop, target, waves),
                launch=launch[spec.name],
            ))
        return rows

    @contextmanager
    def shared_reads(self) -> Iterator[None]:
        global _SHARED
        _SHARED = {}
        try:
            yield
        finally:
            _SHARED = None

    def launch_violations(self, target: Target, spec: KernelSpec, row: KernelAudit) -> list[str]:
        return launch_abi.violations(row.launch, launch_abi.RuntimeLaunch.of(target, spec))


def isa_name(target: Target) -> str:
    """The ISA a code object built for ``target`` names (as comgr reads it): no xnack/sramecc
    setting is built in, so no feature suffix."""
    return f"amdgcn-amd-amdhsa--{target.name}"


def _check_code_object_version(code_object: Path, version: int) -> None:
    """The ELF header says ``version``: a runtime older than the version a code object is built for
    refuses to load it, so a compiler that ignored the flag must fail the build, not the user."""
    with code_object.open("rb") as f:
        ident = f.read(16)
    if ident[:4] != b"\x7fELF" or ident[7] != _ELFOSABI_AMDGPU_HSA:
        raise AuditError(f"{code_object}: not an AMDGPU HSA code object (ELF ident {ident.hex()})")
    expected = ELF_ABI_VERSION[version]
    if ident[8] != expected:
        found = {abi: v for v, abi in ELF_ABI_VERSION.items()}.get(ident[8])
        raise AuditError(f"{code_object}: ELF ABI version {ident[8]} (code object "
                         f"{f'v{found}' if found else 'version unknown'}), expected {expected} (code object "
                         f"v{version}, -mcode-object-version={version})")


def _check_isa_name(co: CodeObject, target: Target) -> None:
    """Where this machine has ROCm's code object manager and it knows the target, it names the ISA
    the loader will match against the GPU: a code object it refuses would not load under that ROCm
    (comgr.py). A target newer than that ROCm (gfx11 under comgr 5.2) is not its to judge."""
    loader = comgr.find()
    if loader is None or isa_name(target) not in loader.isas:
        return
    try:
        name = loader.isa_name(co.data)
    except comgr.ComgrError as e:
        raise AuditError(f"{co.name}: the code object manager {loader} refuses it: {e}; the HIP runtime of that "
                         "ROCm would not load it") from None
    if name != isa_name(target):
        raise AuditError(f"{co.name}: the code object manager {loader} reads ISA {name}, expected {isa_name(target)}")


@dataclass
class _MachineCode:
    """What the audit reads from a code object's machine code: per kernel, the instruction counts,
    the instructions, and the main loop's counts (cost.loop_counts) once asked for."""

    counts: dict[str, dict[str, int]]
    code: dict[str, list[cost.Instruction]]
    loops: dict[tuple, cost.LoopCounts | None] = field(default_factory=dict)

    def loop(self, kernel: str, product: str, products_per_step: float | None) -> cost.LoopCounts | None:
        key = (kernel, product, products_per_step)
        if key not in self.loops:
            self.loops[key] = cost.loop_counts(self.code.get(kernel, []), product, products_per_step)
        return self.loops[key]


# The targets of one compile (gfx1030-gfx1036: assemble.py) hold byte-identical machine code; their
# code objects differ only in their notes (the ISA name and the metadata, read per target). Within
# Amdgcn.shared_reads (build.py audits a compile's targets in one), the disassembly and the loop
# analysis, most of an audit's time, are kept for the code read last, by what they follow from.
_SHARED: dict | None = None  # (objdump, isa, code digest) -> _MachineCode


def _machine_code(tc: Toolchain, target: Target, co: CodeObject, code_object: Path) -> _MachineCode:
    if _SHARED is None:
        return _MachineCode(*_disassembly(tc, code_object))
    key = (tc.objdump, target.isa, co.code_digest())
    if key not in _SHARED:
        _SHARED.clear()  # one code object's instructions in memory at a time (a few hundred MB)
        _SHARED[key] = _MachineCode(*_disassembly(tc, code_object))
    return _SHARED[key]


def _disassembly(tc: Toolchain, code_object: Path) -> tuple[dict[str, dict[str, int]],
                                                          dict[str, list[cost.Instruction]]]:
    """Per kernel: the audit's instruction counts, and its instructions for the cost model."""
    out = subprocess.run([tc.objdump, "-d", "--no-show-raw-insn", str(code_object)],
                         capture_output=True, text=True, check=True).stdout
    counts: dict[str, dict[str, int]] = {}
    code: dict[str, list[cost.Instruction]] = {}
    fields: dict[str, tuple[str, ...]] = {}  # mnemonic -> the counts it adds to
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
            counted = fields.get(mnemonic)
            if counted is None:
                counted = fields[mnemonic] = tuple(f for f, prefix in MNEMONICS.items() if mnemonic.startswith(prefix))
            for f in counted:
                current[f] += 1
            if parsed:
                target = start + int(parsed["off"], 16) if parsed["off"] and mnemonic.startswith(("s_branch", "s_cbranch")) else None
                listing.append(cost.Instruction(int(parsed["addr"], 16), mnemonic, operands.strip(), target))
    return counts, code


PLATFORM = Amdgcn()
