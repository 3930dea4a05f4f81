"""Targets of one instruction set share one compile (build.py's _shared_compiles, assemble.py): the
code object each assembles from the shared assembly is the one its own compile would give."""

import subprocess

import pytest

from elftools.elf.elffile import ELFFile

from rdnattention_gen import assemble, build, toolchain
from rdnattention_gen.matrix import load_matrix
from rdnattention_gen.render import generate

ASM = """\t.amdgcn_target "amdgcn-amd-amdhsa--gfx1030"
\t.text
k:
\ts_endpgm
\t.amdgpu_metadata
---
amdhsa.target:   amdgcn-amd-amdhsa--gfx1030
amdhsa.version:
...
\t.end_amdgpu_metadata
"""


def test_retarget_rewrites_the_directive_and_the_metadata():
    out = assemble.retarget(ASM, "gfx1030", "gfx1034")
    assert out == ASM.replace("--gfx1030", "--gfx1034")
    assert assemble.retarget(ASM, "gfx1030", "gfx1030") is ASM


@pytest.mark.parametrize("text, what", [
    (ASM.replace('\t.amdgcn_target "amdgcn-amd-amdhsa--gfx1030"\n', ""), ".amdgcn_target directive"),
    (ASM.replace("amdhsa.target:   amdgcn-amd-amdhsa--gfx1030\n", ""), "amdhsa.target metadata entry"),
    (ASM + '\t.amdgcn_target "amdgcn-amd-amdhsa--gfx1030"\n', ".amdgcn_target directive"),
    (ASM.replace("--gfx1030\"", "--gfx1030:xnack+\""), ".amdgcn_target directive"),
])
def test_retarget_refuses_assembly_that_names_its_target_otherwise(text, what):
    with pytest.raises(assemble.RetargetError, match=what):
        assemble.retarget(text, "gfx1030", "gfx1031")


def test_targets_group_by_isa_and_identical_sources(matrix, tmp_path):
    rdna2 = [matrix.target(n) for n in ("gfx1031", "gfx1030", "gfx1032", "gfx906")]
    generate(matrix, rdna2, tmp_path)
    groups = build._shared_compiles(rdna2, tmp_path)
    assert [t.name for t in groups["gfx1031"]] == ["gfx1030", "gfx1031", "gfx1032"]
    assert groups["gfx1032"] is groups["gfx1030"]
    assert [t.name for t in groups["gfx906"]] == ["gfx906"]
    # A source that differs by more than the name: that target compiles alone.
    kernel = next(p for p in sorted((tmp_path / "gfx1032").iterdir()) if p.name.startswith("fa2_"))
    kernel.write_text(kernel.read_text() + "\n// differs\n")
    groups = build._shared_compiles(rdna2, tmp_path)
    assert [t.name for t in groups["gfx1030"]] == ["gfx1030", "gfx1031"]
    assert [t.name for t in groups["gfx1032"]] == ["gfx1032"]
    # Without the target named by isa, the first of the others is compiled.
    generate(matrix, [matrix.target("gfx1033")], tmp_path)
    groups = build._shared_compiles(rdna2[:1] + rdna2[3:] + [matrix.target("gfx1033")], tmp_path)
    assert [t.name for t in groups["gfx1033"]] == ["gfx1031", "gfx1033"]


def test_default_build_compiles_each_instruction_set_once(matrix, default_audit, build_dir):
    # The file the default build writes (written here again: another test's build may hold build.ninja now)
    ninja = build._ninja_file(matrix, matrix.select("default"), build_dir, toolchain.find()).replace("$\n    ", "")
    sets = {}
    for t in matrix.select("default"):
        sets.setdefault(t.isa, []).append(t.name)
    shared = {isa: names for isa, names in sets.items() if len(names) > 1}
    assert "gfx1030" in shared and len(shared["gfx1030"]) == 7
    assert ninja.count(": amdgcn_asm ") == len(shared)
    for isa, names in shared.items():
        assert f"{build_dir}/{isa}/kernels.s: amdgcn_asm {build_dir}/gen/{isa}/kernels.cpp" in ninja
        for name in names:
            assert (build_dir / name / "kernels.hsaco").is_file()
            assert f"{build_dir}/{name}/kernels.hsaco: amdgcn_assemble {build_dir}/{isa}/kernels.s" in ninja
    assert ninja.count(": amdgcn ") == len(sets) - len(shared)  # the others compile alone, as before


def _sections(path):
    """What a loader and the audit read of a code object: its ELF flags (the target), code, kernel
    descriptors and metadata note, with their addresses."""
    with open(path, "rb") as f:
        elf = ELFFile(f)
        return elf.header["e_flags"], {name: (elf.get_section_by_name(name)["sh_addr"],
                                              elf.get_section_by_name(name).data())
                                       for name in (".text", ".rodata", ".note")}


def _groups(matrix):
    by_isa = {}
    for t in matrix.targets:
        if t.platform == "amdgcn":
            by_isa.setdefault(t.isa, []).append(t)
    return {isa: sorted(ts, key=lambda t: (t.name != isa, t.name)) for isa, ts in by_isa.items() if len(ts) > 1}


@pytest.mark.parametrize("isa", sorted(_groups(load_matrix())))
def test_assembled_code_object_equals_a_direct_compile(matrix, tmp_path, isa):
    """For every instruction set variants.yaml declares shared: kernels of each family, compiled to
    assembly for the first target and assembled for each of the others, give the .text, .rodata (the
    kernel descriptors) and .note (the metadata) of a compile for that target itself, and its ELF flags."""
    tc = toolchain.find()
    first, *others = _groups(matrix)[isa]
    generate(matrix, [first], tmp_path)
    gen = tmp_path / first.name
    families = {}
    for spec in matrix.specs_for(first):
        families.setdefault(spec.family, spec.name)
    tu = tmp_path / "some.cpp"
    tu.write_text("".join(f'#include "{name}.cpp"\n' for name in families.values()))
    flags = ["-x", "hip", "--offload-device-only", "-nogpuinc", "-nogpulib", "--no-gpu-bundle-output",
             "-mcode-object-version=4", "-O3", "-std=c++17", "-fno-strict-aliasing",
             f"-I{build.INCLUDE_DIR}", f"-I{gen}"]
    asm = tmp_path / "some.s"
    subprocess.run([tc.clang, *flags, f"--offload-arch={first.name}", "-S", str(tu), "-o", str(asm)], check=True)
    for target in [first, *others]:
        direct, assembled = tmp_path / f"{target.name}.direct", tmp_path / f"{target.name}.assembled"
        subprocess.run([tc.clang, *flags, f"--offload-arch={target.name}", str(tu), "-o", str(direct)], check=True)
        assemble.assemble(tc.clang, first.name, target.name, 4, asm, assembled)
        assert _sections(assembled) == _sections(direct), target.name
