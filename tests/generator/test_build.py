"""Building and auditing: every default target, incremental rebuilds, and a new target from YAML alone."""

import json
import re
import subprocess
import sys

import pytest

import small_matrix
from conftest import REPO_ROOT

from rdnattention_gen import DEFAULT_VARIANTS, audit, build, dispatch, toolchain
from rdnattention_gen.families import spec_from_name
from rdnattention_gen.hsaco import CodeObject
from rdnattention_gen.platforms import amdgcn

INT8_KERNELS = ("fa2_i8_", "fa2_i8dec_")  # both products through dot4: the INT8 family and its decode

CLI = [sys.executable, "-m", "rdnattention_gen.cli"]


def test_default_targets_pass_the_audit(matrix, default_audit):
    targets = {t.name for t in matrix.select("default")}
    assert {r.target for r in default_audit} == targets
    per_target = len(matrix.specs_for(matrix.target("gfx1030")))
    assert len(default_audit) == len(targets) * per_target
    for row in default_audit:
        assert (row.vgpr_spills, row.sgpr_spills, row.scratch_bytes) == (0, 0, 0), row
        assert row.lds_bytes <= matrix.target(row.target).lds_bytes
        if row.name.startswith(INT8_KERNELS):
            assert row.dot4 > 0, f"{row.target}/{row.name} has no v_dot4"
        elif row.name.startswith("fa2_bwdpre"):
            pass  # rowsum(dO * O), tier fp32: the compiler lowers its fp16 products as it likes (gfx906: dot2)
        elif row.name.startswith(("fa2_append_", "fa2_quant_")):
            # the cache append (copies, and RoPE in float64) and the INT8 quantization: no fp16 products
            assert row.dot2 == 0
        elif row.name.endswith("_dot2_sf16"):
            # the backward's fp16 rows: score products of fp16 pairs; gradients by v_fma_mix_f32 (or, on
            # dual-issue targets, values widened once for fp32 FMAs)
            assert row.dot2 > 0 and row.fma_mix + row.cvt_f32_f16 > 0, f"{row.target}/{row.name}"
        elif row.name.startswith("fa2_bwd") or "_bf16_" in row.name:
            # bf16 widened by a shift into fp32 FMAs, or the backward's fp32 FMAs on values converted
            # when staged: no products of fp16 pairs
            assert row.dot2 == 0
        else:
            assert row.dot2 > 0, f"{row.target}/{row.name} has no v_dot2"
        assert row.waves_per_simd >= 1
    # Every default target has an int8 dot: the INT8 family is built on all of them.
    assert {r.target for r in default_audit if r.name.startswith("fa2_i8_")} == targets


def test_default_code_objects_contain_their_dot_instructions(matrix, default_audit, build_dir):
    """Read the built files independently of the audit: llvm-objdump on the code object of each
    compile. Targets that share a compile (gfx1031-gfx1036 gfx1030's, gfx1012 gfx1011's) have their
    code objects assembled from its assembly, as a direct compile would give them
    (test_shared_compile.py), and their machine code is the compiled target's."""
    tc = toolchain.find()
    targets = matrix.select("default")
    groups = build._shared_compiles(targets, build_dir / "gen")
    compiled = [t for t in targets if groups[t.name][0] is t]
    assert len(compiled) < len(targets)  # (the RDNA2 and RDNA1 families share theirs)
    for target in compiled:
        path = build.code_object_path(target, build_dir)
        asm = subprocess.run([tc.objdump, "-d", str(path)], capture_output=True, text=True, check=True).stdout
        kernels = re.split(r"^[0-9a-f]+ <(fa2_[^>]+)>:$", asm, flags=re.M)[1:]
        names = kernels[0::2]
        assert sorted(names) == sorted(s.name for s in matrix.specs_for(target))
        for name, body in zip(names, kernels[1::2]):
            if name.startswith("fa2_bwdpre"):  # rowsum(dO * O): the compiler's lowering
                continue
            if name.startswith(("fa2_append_", "fa2_quant_")):  # copies, RoPE in float64, quantization
                assert "v_dot" not in body, f"{target.name}/{name}"
                continue
            if name.endswith("_dot2_sf16"):  # the backward's fp16 rows: pair products, mixed FMAs or widenings
                assert "v_dot2" in body and ("v_fma_mix_f32" in body or "v_cvt_f32_f16" in body), \
                    f"{target.name}/{name}"
                continue
            if name.startswith("fa2_bwd") or "_bf16_" in name:  # fp32 FMAs
                assert "v_dot" not in body, f"{target.name}/{name}"
                continue
            assert ("v_dot4" if name.startswith(INT8_KERNELS) else "v_dot2") in body, f"{target.name}/{name}"


def test_gfx11_bf16_kernels_multiply_with_the_bf16_dot(matrix, build_dir):
    """gfx1100's bf16 forward and decode kernels and the backward's bf16 passes that stage rows
    (tier bf16_dot2) hold v_dot2_f32_bf16 and no fp16 dot, read from the code object with
    llvm-objdump; its fp16 kernels hold no bf16 dot."""
    target = matrix.target("gfx1100")
    build.build(matrix, [target], build_dir, log=lambda *_: None)
    asm = subprocess.run([toolchain.find().objdump, "-d", str(build.code_object_path(target, build_dir))],
                         capture_output=True, text=True, check=True).stdout
    kernels = re.split(r"^[0-9a-f]+ <(fa2_[^>]+)>:$", asm, flags=re.M)[1:]
    bodies = dict(zip(kernels[0::2], kernels[1::2]))
    dot = {s.name for s in matrix.specs_for(target) if s.tier == "bf16_dot2"}
    assert dot and dot == {s.name for s in matrix.specs_for(target)
                           if s.option("dtype") == "bf16" and (s.family in ("f16", "dec") or s.stage == "bf16")}
    assert any(s.family == "bwd" for s in matrix.specs_for(target) if s.name in dot)
    assert dot <= set(bodies)
    for name, body in bodies.items():
        if name in dot:
            assert "v_dot2_f32_bf16" in body and "v_dot2_f32_f16" not in body, name
        else:
            assert "v_dot2_f32_bf16" not in body, name


def test_waves_per_simd_follows_llvm_rules(matrix):
    rdna2, gcn5 = matrix.target("gfx1030"), matrix.target("gfx906")
    assert [rdna2.waves_per_simd(v, 0, 256) for v in (64, 80, 96, 128, 160, 192, 256)] == [16, 12, 10, 8, 6, 5, 4]
    assert [gcn5.waves_per_simd(v, 0, 256) for v in (24, 32, 48, 64, 84, 128)] == [10, 8, 5, 4, 3, 2]
    assert rdna2.waves_per_simd(64, 40000, 256) == 6  # three 8-wave workgroups per WGP's 128 KiB


def test_audit_rules_catch_violations(matrix, default_audit):
    target = matrix.target("gfx1030")
    spec = next(s for s in matrix.specs_for(target) if s.family == "f16" and s.option("dtype") is None)
    row = next(r for r in default_audit if r.target == "gfx1030" and r.name == spec.name)
    assert audit.violations(target, spec, row) == []
    bad = audit.KernelAudit(**{**row.to_json(), "vgpr_spills": 3, "scratch_bytes": 64, "lds_bytes": 70000, "dot2": 0})
    assert audit.violations(target, spec, bad) == [
        "spills 3 VGPRs and 0 SGPRs",
        "uses 64 bytes of scratch",
        "uses 70000 bytes of LDS, over the 65536 budget",
        f"allocates 70000 bytes of LDS but its layout says {spec.lds_bytes}",
        "tier dot2 but no v_dot2 instruction in the kernel",
    ]
    with pytest.raises(audit.AuditError, match="audit failed"):
        audit.check(target, [spec], [bad])


TIER2 = {"gfx1010": "fma_mix", "gfx904": "fma_mix", "gfx900": "mad_mix", "gfx902": "mad_mix",
         "gfx90c": "mad_mix", "gfx803": "cvt_f32_f16"}


@pytest.fixture(scope="module")
def tier2_build(matrix, tmp_path_factory):
    """The tier-2 targets built at head_dim 64 (Matrix.narrowed), in a directory of their own:
    every family and lowering, in a small part of their full build's compile. Their full builds'
    rows are docs/hardware.md's, which test_docs.py holds to the digest of their sources."""
    m, out = matrix.narrowed((64,), TIER2), tmp_path_factory.mktemp("tier2")
    return m, out, build.build(m, [m.target(n) for n in TIER2], out, log=lambda *_: None, audit_processes=2)


@pytest.fixture(scope="module")
def tier2_audit(tier2_build):
    return tier2_build[2]


def test_a_compiles_targets_read_its_machine_code_once(tier2_build, monkeypatch):
    """gfx900, gfx902 and gfx90c are one compile, their code objects the same but for their notes:
    their audits disassemble it once, and give each the rows a fresh read of its own code object gives."""
    m, out, rows = tier2_build
    names = ["gfx900", "gfx902", "gfx90c"]
    digests = {n: CodeObject.read(out / n / "kernels.hsaco").code_digest() for n in names + ["gfx904"]}
    assert digests["gfx900"] == digests["gfx902"] == digests["gfx90c"] != digests["gfx904"]
    reads, disassembly = [], amdgcn._disassembly
    monkeypatch.setattr(amdgcn, "_disassembly", lambda tc, path: reads.append(path) or disassembly(tc, path))
    tc = toolchain.find()

    def audit_of(name):
        return amdgcn.PLATFORM.audit(tc, m.target(name), m.specs_for(m.target(name)), out)

    with amdgcn.PLATFORM.shared_reads():
        shared = [audit_of(n) for n in names]
    assert reads == [out / "gfx900" / "kernels.hsaco"] and amdgcn._SHARED is None  # nothing kept past it
    for name, got in zip(names, shared):
        assert got == audit_of(name) == [r for r in rows if r.target == name]
    assert len(reads) == 4


def test_every_head_dim_is_built_for_every_target(matrix, default_audit):
    """Every GPU target builds every head_dim of the fp16 kernels; the default targets' builds
    have no spill and fit their LDS (the build fails otherwise: every target's rows in
    docs/hardware.md came from such a build)."""
    head_dims = set(matrix.kernels["f16"]["head_dims"])
    assert head_dims == set(range(8, 257, 8)) | set(range(288, 513, 32))
    for target in matrix.select("all"):
        assert {s.head_dim for s in matrix.specs_for(target)} == head_dims, target.name
    for target in matrix.select("default"):
        rows = [r for r in default_audit if r.target == target.name]
        assert {spec_from_name(r.name).head_dim for r in rows} == head_dims, target
        assert all((r.vgpr_spills, r.sgpr_spills, r.scratch_bytes) == (0, 0, 0) for r in rows), target
        assert all(r.lds_bytes <= target.lds_bytes for r in rows), target


@pytest.mark.parametrize("name", sorted(TIER2))
def test_tier2_targets_use_their_lowering(matrix, tier2_audit, name):
    # The fp16 kernels (the cache append and the INT8 quantization have no fp16 products; the bf16
    # kernels' are fp32 FMAs on shifted values)
    rows = [r for r in tier2_audit if r.target == name
            and not r.name.startswith(("fa2_bwd", "fa2_append_", "fa2_quant_")) and "_bf16_" not in r.name]
    field = TIER2[name]
    assert rows and all(getattr(r, field) > 0 and r.dot2 == 0 for r in rows)
    bf16 = [r for r in tier2_audit if r.target == name and "_bf16_" in r.name]
    assert bf16 and all(r.dot2 == 0 and r.fma_mix == 0 and r.mad_mix == 0 for r in bf16)
    if field == "fma_mix":
        assert all(r.mad_mix == 0 for r in rows)


def test_gcn_runs_wave64_and_rdna_wave32(default_audit, tier2_audit):
    for r in default_audit + tier2_audit:
        gcn = r.target.startswith("gfx9") or r.target == "gfx803"
        assert r.wave_size == (64 if gcn else 32), r
        assert re.search(rf"_w{r.wave_size}(_|$)", r.name), r.name


def test_second_build_compiles_nothing(default_audit, build_dir):
    out = subprocess.run(CLI + ["build", "--targets", "default", "--build-dir", str(build_dir)],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert "build: up to date, nothing compiled" in out.stdout
    assert "HIP " not in out.stdout


def test_audit_json_lists_every_kernel(matrix, default_audit, build_dir):
    out = subprocess.run(CLI + ["audit", "--json", "--targets", "default", "--build-dir", str(build_dir)],
                         capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    rows = json.loads(out.stdout)
    assert len(rows) == len(default_audit)
    assert set(rows[0]) == {"target", "name", "vgprs", "sgprs", "vgpr_spills", "sgpr_spills", "scratch_bytes",
                            "lds_bytes", "wave_size", "waves_per_simd", "dot2", "dot4", "fma_mix", "mad_mix",
                            "cvt_f32_f16", "loop", "bound", "peak_share", "launch"}
    amd = next(r for r in rows if r["target"] == "gfx1030")
    assert set(amd["launch"]) == {"args", "kernarg_segment_size", "kernarg_segment_align", "max_flat_workgroup_size",
                                  "uses_dynamic_stack", "descriptor"}


def test_audit_without_a_build_names_the_command(tmp_path):
    out = subprocess.run(CLI + ["audit", "--targets", "gfx1030", "--build-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 2
    assert "run: rdnattention-gen build --targets gfx1030" in out.stderr


def test_head_dims_narrow_what_the_commands_build(matrix):
    """--head-dims (Matrix.narrowed) on the commands that name a build's kernels; a bad list and a
    head_dim the target does not build are named, exit status 2. (scripts/test_install.sh builds
    the host targets so and runs the install's tests on that build.)"""
    out = subprocess.run(CLI + ["list", "--targets", "gfx1030", "--head-dims", "64,80"], capture_output=True,
                         text=True, cwd=REPO_ROOT, check=True).stdout
    names = [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
    narrow = matrix.narrowed((64, 80), ["gfx1030"])
    assert names == [v.spec.name for v in narrow.variants_for(narrow.target("gfx1030"))]
    assert {n for n in names if "_hd" in n} and all("_hd64_" in n or "_hd80_" in n for n in names if "_hd" in n)
    for value, message in [("64,x", "argument --head-dims: '64,x' is not a comma list of positive head_dims"),
                           ("0", "argument --head-dims: '0' is not a comma list"),
                           ("72", "error: head_dim 72: host builds none of its kernels there")]:
        out = subprocess.run(CLI + ["build", "--targets", "host", "--head-dims", value, "--build-dir", "/nonexistent"],
                             capture_output=True, text=True, cwd=REPO_ROOT)
        assert out.returncode == 2 and message in out.stderr, out.stderr


def test_audit_of_a_build_of_fewer_kernels_names_them(matrix, tmp_path):
    """A build's dispatch table without kernels the matrix lists (built with --head-dims, then
    audited without): named, with what to do, before its code object is read."""
    narrow = matrix.narrowed((64,), ["gfx1030"])
    (tmp_path / "gfx1030").mkdir()
    (tmp_path / "gfx1030" / "kernels.hsaco").write_bytes(b"")
    table = dispatch.table(narrow.target("gfx1030"), narrow.variants_for(narrow.target("gfx1030")),
                           tmp_path / "gfx1030" / "kernels.hsaco", False, "clang", ["gfx1030"])
    (tmp_path / "gfx1030" / "dispatch.json").write_text(dispatch.dumps(table))
    with pytest.raises(build.BuildError, match=re.escape(
            f"{tmp_path / 'gfx1030'} holds {len({k['name'] for k in table['kernels']})} kernels and not "
            f"{len(matrix.specs_for(matrix.target('gfx1030'))) - len(narrow.specs_for(narrow.target('gfx1030')))} "
            "of those the matrix lists for gfx1030 (such as ")):
        build.audit_target(matrix, matrix.target("gfx1030"), tmp_path)


@pytest.mark.slow
def test_new_target_needs_only_a_yaml_entry(tmp_path):
    """gfx1013 (an RDNA1 part) is not listed; one entry in a copy of variants.yaml builds it."""
    text = DEFAULT_VARIANTS.read_text()
    entry = ("  gfx1013:\n    <<: *rdna1\n    parts: test entry\n    fdot2: false\n    int8_dot: none\n"
             "    hw_tier: 2\n    default: false\n")
    # The copy is cut down to head_dim 64 (tests/small_matrix.py): the entry is the test, not the kernels.
    variants, tuned = small_matrix.write(tmp_path, text=text.replace("  gfx1012:\n", entry + "  gfx1012:\n", 1))
    out = subprocess.run(CLI + ["build", "--variants", str(variants), "--tuned", str(tuned), "--targets", "gfx1013",
                                "--build-dir", str(tmp_path / "build")], capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "build" / "gfx1013" / "kernels.hsaco").is_file()
    assert "gfx1013  fa2_f16_hd64_g2_br128_bc32_nt256_tm2_wv6_w32_fma_mix_sf16" in out.stdout  # the rdna table
    probe = subprocess.run(CLI + ["probe", "--variants", str(variants), "--tuned", str(tuned), "--targets", "gfx1013"],
                           capture_output=True, text=True, cwd=REPO_ROOT)
    assert probe.returncode == 0, probe.stdout + probe.stderr


def test_dispatch_table_is_sorted_and_has_fallbacks(matrix, default_audit, build_dir):
    data = json.loads((build_dir / "gfx1030" / "dispatch.json").read_text())
    keys = [(e["family"], e["head_dim"], -e["gqa_group"]) for e in data["kernels"]]
    assert keys == sorted(keys)
    assert {(e["head_dim"], e["gqa_group"]) for e in data["kernels"]} >= {(64, 1), (128, 1)}
    assert data["code_object"] == "kernels.hsaco"


def test_probe_agrees_with_variants(matrix):
    out = subprocess.run(CLI + ["probe", "--targets", "gfx1030,gfx906,gfx1010,gfx900,gfx803,gfx1100"],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every claim in variants.yaml matches the compiler" in out.stdout


def test_audit_covers_the_host_platform(matrix, host_build, build_dir):
    """The host targets' kernels declare their LDS as symbols; the audit checks them against the layout."""
    out = subprocess.run(CLI + ["audit", "--json", "--targets", "host,host_f32", "--build-dir", str(build_dir)],
                         capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    rows = json.loads(out.stdout)
    specs = {(t, s.name): s for t in ("host", "host_f32") for s in matrix.specs_for(matrix.target(t))}
    assert len(rows) == len(specs) and {r["target"] for r in rows} == {"host", "host_f32"}
    for r in rows:
        assert r["lds_bytes"] == specs[r["target"], r["name"]].lds_bytes and r["vgprs"] is None, r


class _Bar:
    """What run_ninja needs of a tqdm bar."""

    def __init__(self):
        self.n, self.total, self.steps = 0, 0, []

    def update(self, k):
        self.n += k
        self.steps.append(self.n)


def test_ninja_progress_advances_a_bar(tmp_path, capsys):
    """`pip wheel .` hides the build's output without -v, so setup.py hands run_ninja a bar on the
    terminal: ninja's [done/total] lines advance it to the end, and the lines are still passed through."""
    (tmp_path / "build.ninja").write_text(
        "rule touch\n  command = touch $out\n" + "".join(f"build o{i}: touch\n" for i in range(3)))
    bar = _Bar()
    assert build.run_ninja(tmp_path, [f"o{i}" for i in range(3)], jobs=1, progress=bar)
    assert (bar.n, bar.total) == (3, 3) and bar.steps == [1, 2, 3]
    assert "[3/3]" in capsys.readouterr().out
    assert not build.run_ninja(tmp_path, ["o0"], jobs=1, progress=_Bar())  # nothing to do: no step
