"""Generator inputs that used to break it: directories whose names a shell would run, a variants
file of nested aliases, files that are not UTF-8. Each builds correctly or is one typed error line."""

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import ninja
import pytest
import small_matrix
from conftest import REPO_ROOT

from rdnattention_gen import DEFAULT_VARIANTS, toolchain
from rdnattention_gen.matrix import load_matrix
from rdnattention_gen.ninja_paths import Writer, command_path
from rdnattention_gen.strict_yaml import MAX_ALIASED_NODES, VariantsError, load

CLI = [sys.executable, "-m", "rdnattention_gen.cli"]
NINJA = str(Path(ninja.BIN_DIR) / "ninja")
# Space, '$', ';', backtick, $(...) and quotes: a shell given any path under it unquoted creates PWNED*.
HOSTILE = "a b$c;touch PWNED;`touch PWNED2`$(touch PWNED3)'q\""


def _cli(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})},
                          timeout=300)


def _assert_nothing_else_ran(root: Path) -> None:
    stray = sorted(root.rglob("PWNED*")) + sorted(REPO_ROOT.glob("PWNED*"))
    assert not stray


@pytest.fixture(scope="module")
def hostile_checkout(tmp_path_factory) -> Path:
    """The two packages copied under HOSTILE (so INCLUDE_DIR and HOST_DIR are hostile paths), with
    clang linked beside them; run them with PYTHONPATH and RDNATTENTION_CLANG from _hostile_env."""
    root = tmp_path_factory.mktemp("paths") / HOSTILE
    for package in ("rdnattention", "rdnattention_gen"):
        shutil.copytree(REPO_ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    clang = Path(toolchain.find().clang)
    (root / "bin").mkdir()
    (root / "bin" / clang.name).symlink_to(clang)
    return root


def _hostile_env(root: Path) -> dict:
    return {"PYTHONPATH": str(root), "RDNATTENTION_CLANG": str(next((root / "bin").iterdir()))}


@pytest.mark.slow
def test_hostile_checkout_and_build_dir_build_and_run_nothing_else(hostile_checkout):
    root, env = hostile_checkout, _hostile_env(hostile_checkout)
    cwd = root.parent / "cwd"
    cwd.mkdir()
    build_dir = root / "build"
    variants, tuned = small_matrix.write_one_family(root / "matrix")  # a few kernels: the paths are the test
    args = ["build", "--targets", "host,gfx1030", "--build-dir", str(build_dir), "--variants", str(variants),
            "--tuned", str(tuned)]
    out = _cli(args, cwd, env)
    assert out.returncode == 0, out.stdout + out.stderr
    hsaco = build_dir / "gfx1030" / "kernels.hsaco"
    assert hsaco.is_file() and (build_dir / "host" / "librdnattention_host.so").is_file()
    # The command ninja ran, split as the shell split it: every path is one whole word.
    command = subprocess.run([NINJA, "-C", str(build_dir), "-t", "commands", str(hsaco)],
                             capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    argv = shlex.split(command)
    assert argv[0] == env["RDNATTENTION_CLANG"]
    assert f"-I{root / 'rdnattention_gen' / 'templates' / 'include'}" in argv
    assert argv[-3:] == [str(build_dir / "gen" / "gfx1030" / "kernels.cpp"), "-o", str(hsaco)]
    again = _cli(args, cwd, env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "build: up to date, nothing compiled" in again.stdout
    _assert_nothing_else_ran(root.parent)


# Stands in for clang and ptxas: logs its argv and writes the files the rule expects.
FAKE_TOOL = """\
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_TOOL_LOG"], "a") as log:
    log.write(json.dumps(sys.argv) + "\\n")
for flag in ("-o", "-MF"):
    if flag in args:
        open(args[args.index(flag) + 1], "w").close()
"""

WRITE_NINJA = """\
import sys
from pathlib import Path
from rdnattention_gen import build, render, toolchain
from rdnattention_gen.matrix import load_matrix
clang, ptxas, build_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
toolchain.find_ptxas = lambda arch: ptxas
matrix = load_matrix()
targets = matrix.select("host,gfx1030,sm_90")
render.generate(matrix, targets, build_dir / "gen")
for target in targets:
    render.write_if_changed(build_dir / target.name / "toolchain.txt", "fake\\n")
tc = toolchain.Toolchain(clang=clang, readelf="", objdump="", nm="", identity="fake")
(build_dir / "build.ninja").write_text(build._ninja_file(matrix, targets, build_dir, tc))
print("\\n".join(str(build.code_object_path(t, build_dir)) for t in targets))
"""


def test_every_platforms_rules_keep_hostile_paths_whole(hostile_checkout):
    """host, amdgcn and cuda (clang, then ptxas) rules run by ninja, with stand-in tools that log
    their argv: every path arrives as one argument, and nothing else runs."""
    root = hostile_checkout
    tools = root / "fake tools $x;`y`"
    tools.mkdir()
    for name in ("clang", "ptxas"):
        (tools / name).write_text(f"#!{sys.executable}\n{FAKE_TOOL}")
        (tools / name).chmod(0o755)
    build_dir = root / "fake build"
    log = root.parent / "tools.log"
    written = subprocess.run([sys.executable, "-c", WRITE_NINJA, str(tools / "clang"), str(tools / "ptxas"),
                              str(build_dir)], capture_output=True, text=True, cwd=root.parent,
                             env={**os.environ, "PYTHONPATH": str(root)})
    assert written.returncode == 0, written.stderr
    run = subprocess.run([NINJA, "-C", str(build_dir)] + written.stdout.split("\n")[:-1], capture_output=True,
                         text=True, env={**os.environ, "FAKE_TOOL_LOG": str(log)})
    assert run.returncode == 0, run.stdout + run.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    # host: two compiles and a link; gfx1030: one compile; sm_90: clang to PTX, ptxas to a cubin.
    assert sorted(Path(c[0]).name for c in calls) == ["clang"] * 5 + ["ptxas"]
    assert all(c[0] in (str(tools / "clang"), str(tools / "ptxas")) for c in calls)
    include = f"-I{root / 'rdnattention_gen' / 'templates' / 'include'}"
    assert sum(include in c for c in calls) == 4  # every compile but the link and ptxas
    for call in calls:
        for arg in call[1:]:
            path = arg[2:] if arg.startswith("-I") else arg
            if path.startswith(str(root)):
                assert Path(path).exists(), (path, call)
    assert (build_dir / "sm_90" / "kernels.cubin.ptxas.txt").is_file()
    _assert_nothing_else_ran(root.parent)


@pytest.mark.slow
def test_a_depfile_holds_space_dollar_and_hash(tmp_path):
    """Paths ninja's depfile reader takes keep the depfile; a second build finds nothing to do."""
    build_dir = tmp_path / "d$ir #1 (x)" / "build"
    variants, tuned = small_matrix.write_one_family(tmp_path / "matrix")  # a few kernels: the depfile is the test
    args = ["build", "--targets", "host", "--build-dir", str(build_dir), "--variants", str(variants), "--tuned",
            str(tuned)]
    out = _cli(args, REPO_ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "depfile = \n" not in (build_dir / "build.ninja").read_text()
    deps = subprocess.run([NINJA, "-C", str(build_dir), "-t", "deps", str(build_dir / "host" / "kernels.o")],
                          capture_output=True, text=True, check=True).stdout
    assert f"    {build_dir / 'gen' / 'host' / 'prelude.h'}\n" in deps
    again = _cli(args, REPO_ROOT)
    assert "build: up to date, nothing compiled" in again.stdout, again.stdout + again.stderr


def test_a_path_ninja_cannot_hold_is_one_error_line(tmp_path):
    build_dir = tmp_path / "a|b"
    out = _cli(["build", "--targets", "host", "--build-dir", str(build_dir)], REPO_ROOT)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [f"rdnattention-gen: error: {str(build_dir / 'gen' / 'host' / 'kernels.cpp')!r}: "
                                       "build.ninja cannot hold a path containing '|'; use another directory"]


def _laughs(shape: str) -> str:
    """Nine levels of nine aliases each: 9**9 leaves from 1 KB of YAML."""
    lines = ["# nested aliases", "a: &a " + ("[x, x, x, x, x, x, x, x, x]" if shape == "list" else
                                             "{" + ", ".join(f"k{i}: x" for i in range(9)) + "}")]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        items = [f"*{prev}"] * 9 if shape == "list" else [f"k{i}: *{prev}" for i in range(9)]
        lines.append(f"{name}: &{name} " + ("[" if shape == "list" else "{") + ", ".join(items)
                     + ("]" if shape == "list" else "}"))
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("shape, line, anchor", [("list", 7, "e"), ("map", 6, "d")])
def test_nested_aliases_are_refused_quickly(tmp_path, shape, line, anchor):
    variants = tmp_path / "variants.yaml"
    variants.write_text(_laughs(shape))
    message = (f"variants.yaml:{line}: alias *{anchor}: the aliases of this file expand to more than "
               f"{MAX_ALIASED_NODES} nodes (nested aliases?)")
    start = time.monotonic()
    with pytest.raises(VariantsError) as e:
        load_matrix(variants, None)
    assert time.monotonic() - start < 2
    assert str(e.value) == message
    out = _cli(["build", "--variants", str(variants), "--targets", "host", "--build-dir", str(tmp_path / "build")],
               REPO_ROOT)
    assert (out.returncode, out.stderr) == (2, f"rdnattention-gen: error: {message}\n")


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    variants = tmp_path / "variants.yaml"
    variants.write_text("kernels: {}\nloop: &loop [1, *loop]\n")
    with pytest.raises(VariantsError, match=r"^variants.yaml:2: alias \*loop: refers to the node that contains it$"):
        load(variants)


@pytest.mark.parametrize("content, message", [
    (b"# matrix\nkernels:\n  f16: {note: \"caf\xe9\"}\n", "variants.yaml:3: not UTF-8: byte 0xe9 at column 19"),
    (b"\xff\xfe", "variants.yaml:1: not UTF-8: byte 0xff at column 1"),
    (b"kernels: {}\nnote: \"\x07\"\n", "variants.yaml:2: special characters are not allowed: character U+0007"),
], ids=["latin-1", "utf-16", "control"])
def test_a_variants_file_that_is_not_text_is_one_error_line(tmp_path, content, message):
    variants = tmp_path / "variants.yaml"
    variants.write_bytes(content)
    with pytest.raises(VariantsError) as e:
        load_matrix(variants, None)
    assert str(e.value) == message
    out = _cli(["list", "--variants", str(variants)], REPO_ROOT)
    assert (out.returncode, out.stderr) == (2, f"rdnattention-gen: error: {message}\n")


def test_a_tuned_overlay_that_is_not_utf8_names_its_line(tmp_path):
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    (tuned / "gfx1030.yaml").write_bytes(textwrap.dedent("""\
        target: gfx1030
        entries:
          - family: f16
            measured: {device: Radeon\xa0RX 6800}
        """).encode("latin-1"))
    with pytest.raises(VariantsError) as e:
        load_matrix(DEFAULT_VARIANTS, tuned)
    assert str(e.value) == "tuned/gfx1030.yaml:4: not UTF-8: byte 0xa0 at column 30"


def test_paths_round_trip_through_ninja_and_the_shell(tmp_path):
    """Every wrap position of the 100-column writer over a hostile path: ninja's own parser and
    the shell give back the exact path, as a variable and as a build output."""
    w = Writer(io.StringIO(), width=100)
    w.rule("r", command="tool $v $out")
    expected = []
    for k in range(110):
        value, output = "/" + "x" * k + "  a b$c;`d`$(e)'f\" $ g", str(tmp_path / f"out {k} $x:y")
        w.build(output, "r", variables={"v": command_path(value)})
        expected.append(["tool", value, output])
    (tmp_path / "build.ninja").write_text(w.output.getvalue())
    commands = subprocess.run([NINJA, "-C", str(tmp_path), "-t", "commands"], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    assert sorted(map(shlex.split, commands)) == sorted(expected)
