"""Rendering: deterministic bytes, write-if-changed, and a few golden sources."""

from pathlib import Path

import jinja2
import pytest

from rdnattention_gen.render import (environment, generate, render_args, render_fma_peak, render_kernel, render_prelude,
                                     target_files, write_if_changed)

GOLDEN = Path(__file__).parent / "golden"
# The dot2 and inline-asm lowerings, the host and cuda preludes (with their dot4 lowerings), the
# fp16 family's argument struct, one kernel instantiation.
GOLDEN_CASES = {
    "args_f16.h": ("args", "f16"),
    "prelude_gfx1030.h": ("prelude", "gfx1030"),
    "prelude_gfx900.h": ("prelude", "gfx900"),
    "prelude_host.h": ("prelude", "host"),
    "prelude_sm_90.h": ("prelude", "sm_90"),
    "fa2_f16_hd128_g2_br128_bc16_nt256_tm2_wv6_w32_dot2_sf16.cpp": ("kernel", "gfx1030"),
    "fma_peak_sm_90.cpp": ("fma_peak", "sm_90"),
}


def _render(matrix, kind, name, file_name):
    env = environment()
    if kind == "args":
        return render_args(env, name)
    target = matrix.target(name)
    if kind == "prelude":
        return render_prelude(env, target)
    if kind == "fma_peak":
        return render_fma_peak(env, target)
    spec = next(s for s in matrix.specs_for(target) if f"{s.name}.cpp" == file_name)
    return render_kernel(env, spec)


@pytest.mark.parametrize("file_name", sorted(GOLDEN_CASES))
def test_golden_renders(matrix, request, file_name):
    text = _render(matrix, *GOLDEN_CASES[file_name], file_name)
    path = GOLDEN / file_name
    if request.config.getoption("--update-goldens"):
        write_if_changed(path, text)
    assert path.read_text() == text, f"{file_name} differs from its golden; rerun with --update-goldens if intended"


def test_generated_files_say_where_they_came_from(matrix, tmp_path):
    generate(matrix, [matrix.target("gfx906")], tmp_path)
    for path in sorted((tmp_path / "gfx906").iterdir()):
        first = path.read_text().splitlines()[0]
        assert first.startswith("// @generated"), path.name


def test_two_renders_are_byte_identical(matrix, tmp_path):
    targets = matrix.select("all") + matrix.select("host")
    generate(matrix, targets, tmp_path / "a")
    generate(matrix, targets, tmp_path / "b")
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b
    # + prelude, unity file, FMA peak probe, one argument header per family
    assert len(files_a) == sum(len(matrix.specs_for(t)) + 3 + len({s.family for s in matrix.specs_for(t)})
                               for t in targets)
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_unchanged_files_keep_their_mtime(matrix, tmp_path):
    target = [matrix.target("gfx1030")]
    written, total = generate(matrix, target, tmp_path)
    assert written == total
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "gfx1030").iterdir()}
    assert generate(matrix, target, tmp_path) == (0, total)
    assert stamps == {p: p.stat().st_mtime_ns for p in (tmp_path / "gfx1030").iterdir()}


def test_undefined_template_variable_is_an_error(tmp_path):
    (tmp_path / "t.j2").write_text("{{ spec.nmae }}")
    with pytest.raises(jinja2.UndefinedError):
        environment(tmp_path).get_template("t.j2").render(spec={})


def test_the_generator_renders_without_torch():
    """Wheel builds run the generator where torch is not installed: nothing it imports may need it."""
    import subprocess
    import sys

    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'torch' or name.startswith('torch.'):\n"
            "            raise ImportError('torch is blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "from rdnattention_gen import cli, cost, render, tune\n"
            "from rdnattention_gen.matrix import load_matrix\n"
            "m = load_matrix()\n"
            "for t in m.select('default,host,sm_90'):\n"
            "    render.target_files(render.environment(), m, t)\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_family_renders_its_argument_header_for_every_layout(matrix):
    """A build of f16 alone renders args_f16.h, which its kernels of every layout include, and no
    other family's header."""
    import dataclasses

    only = dataclasses.replace(matrix, kernels={"f16": matrix.kernels["f16"]})
    files = target_files(environment(), only, only.target("gfx1030"))
    assert "args_f16.h" in files and "args_dec.h" not in files
    kernels = {name: text for name, text in files.items() if name.startswith("fa2_")}
    assert any(n.startswith("fa2_f16len_") for n in kernels) and any(n.startswith("fa2_f16varlen_") for n in kernels)
    assert all('#include "args_f16.h"' in text for text in kernels.values())
