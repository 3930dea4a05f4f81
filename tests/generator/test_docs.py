"""docs/hardware.md is generated; it must match what the matrix and the audit say now."""

import dataclasses
import re
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from rdnattention_gen import build, docs
from rdnattention_gen.render import generate

HARDWARE_MD = REPO_ROOT / "docs" / "hardware.md"


def _docs(*args, build_dir):
    return subprocess.run([sys.executable, "-m", "rdnattention_gen.cli", "docs", *args, "--build-dir", str(build_dir)],
                          capture_output=True, text=True, cwd=REPO_ROOT)


@pytest.mark.slow  # audits every target the build directory holds (all of them after a full build)
def test_hardware_md_is_up_to_date(build_dir):
    out = _docs("--check", "--audit", "built", build_dir=build_dir)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr
    assert "is up to date" in out.stdout


def test_a_target_not_compiled_is_held_to_its_sources_digest(default_audit, build_dir, tmp_path):
    """--check --audit LIST compiles LIST alone; every other target's rows stand on the digest of
    their sources that the page records: the page as it is passes, and one whose digest for a
    target it did not compile differs fails, naming the file."""
    page = tmp_path / "hardware.md"
    page.write_text(HARDWARE_MD.read_text())
    out = _docs("--check", "--audit", "gfx1030", "--out", str(page), build_dir=build_dir)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr
    held = re.search(r"\((\d+) target\(s\) held to their sources' digest: (.*)\)", out.stdout)
    assert held and "gfx1101" in held.group(2).split(", ") and "gfx1030" not in held.group(2).split(", ")
    digest = re.search(r"^gfx1101 ([0-9a-f]{16})$", page.read_text(), flags=re.M)
    assert digest
    page.write_text(page.read_text().replace(f"gfx1101 {digest.group(1)}", "gfx1101 0000000000000000"))
    out = _docs("--check", "--audit", "gfx1030", "--out", str(page), build_dir=build_dir)
    assert out.returncode == 1 and f"{page} is out of date" in out.stderr


def test_a_compiled_targets_rows_are_checked(default_audit, build_dir, tmp_path):
    """A row of a target --check compiles that differs from its audit fails the check."""
    page = tmp_path / "hardware.md"
    text = HARDWARE_MD.read_text()
    row = re.search(r"^\| `gfx1030`, `gfx1031`[^|]*\| `(fa2_f16_hd64_[^`]+)` \| (\d+) \|", text, flags=re.M)
    assert row
    page.write_text(text.replace(row.group(0), row.group(0)[:-len(row.group(2)) - 2] + f"{int(row.group(2)) + 1} |", 1))
    out = _docs("--check", "--audit", "gfx1030", "--out", str(page), build_dir=build_dir)
    assert out.returncode == 1 and "out of date" in out.stderr


def test_audit_names_what_check_compiles_only(tmp_path):
    out = _docs("--audit", "gfx1030", "--out", str(tmp_path / "hardware.md"), build_dir=tmp_path / "build")
    assert out.returncode == 2 and "--audit names the targets --check compiles" in out.stderr
    assert not (tmp_path / "hardware.md").exists() and not (tmp_path / "build").exists()


def test_the_digest_follows_the_sources_and_the_target(matrix, tmp_path):
    """build.audit_inputs: the same for the same sources and target wherever they are generated;
    different when one generated file changes, or the target's entry."""
    target = matrix.target("gfx803")
    generate(matrix, [target], tmp_path / "a")
    generate(matrix, [target], tmp_path / "b")
    first = build.audit_inputs(target, tmp_path / "a")
    assert re.fullmatch(r"[0-9a-f]{16}", first) and build.audit_inputs(target, tmp_path / "b") == first
    assert build.audit_inputs(dataclasses.replace(target, vgprs_per_simd=target.vgprs_per_simd // 2),
                              tmp_path / "a") != first
    source = next(p for p in sorted((tmp_path / "b" / "gfx803").iterdir()) if p.name.startswith("fa2_f16_hd64"))
    source.write_text(source.read_text() + "\n")
    assert build.audit_inputs(target, tmp_path / "b") != first


def test_without_audit_rows_drops_the_rows_of_those_targets_alone():
    text = HARDWARE_MD.read_text()
    kept = docs.without_audit_rows(text, {"gfx803", "sm_60"})
    removed = set(text.split("\n")) - set(kept.split("\n"))
    assert removed and all(line.startswith(("| `gfx803` |", "| `sm_60` |")) for line in removed)
    assert any(line.startswith("| `gfx803` | amdgcn |") for line in kept.split("\n"))  # the targets table's
    assert kept.split("\n")[-5:] == text.split("\n")[-5:]
