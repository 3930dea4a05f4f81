"""Distributions: which targets each carries (README's table follows the matrix), the kernel wheel
a maintainer builds, and the runtime's lookup through installed kernel distributions."""

import re
import subprocess
import sys
import textwrap
import zipfile

import pytest
from conftest import REPO_ROOT

from rdnattention import dispatch
from rdnattention_gen import cli, packaging


def test_readme_distribution_table_follows_the_matrix(matrix):
    rows = dict(re.findall(r"^\| `([\w.-]+)` \| ([\w, ]+) \|$", (REPO_ROOT / "README.md").read_text(), re.M))
    assert rows == packaging.distributions(matrix)


def test_host_targets_never_go_into_a_wheel(matrix):
    with pytest.raises(packaging.PackagingError, match="host: host targets are built on the machine that runs them"):
        packaging.refuse_host([matrix.target("host")])


def test_kernel_wheel_is_found_through_its_entry_point(matrix, default_audit, build_dir, tmp_path, monkeypatch):
    target = matrix.target("gfx1030")
    wheel = packaging.kernel_wheel("test.only", [target], build_dir, tmp_path)
    assert wheel.name == "rdnattention_kernels_test_only-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {"rdnattention_kernels_test_only/gfx1030/dispatch.json",
                "rdnattention_kernels_test_only/gfx1030/kernels.hsaco"} <= names
        entry = z.read("rdnattention_kernels_test_only-0.1.0.dist-info/entry_points.txt").decode()
        meta = z.read("rdnattention_kernels_test_only-0.1.0.dist-info/METADATA").decode()
        z.extractall(tmp_path / "site")
    assert "[rdnattention.kernels]\ntest_only = rdnattention_kernels_test_only" in entry
    assert "Requires-Dist: rdnattention==0.1.0" in meta
    # Installed (its directory on sys.path): the runtime finds it after the user directory.
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    roots = dispatch.kernel_roots()
    sources = [r.source for r in roots]
    dist = sources.index("distribution rdnattention-kernels-test.only 0.1.0")
    assert sources.index("user directory (rdnattention-gen build --user)") < dist < sources.index("rdnattention package")
    assert roots[dist].path == tmp_path / "site" / "rdnattention_kernels_test_only"
    table = dispatch.load_table(roots[dist].path / "gfx1030" / "dispatch.json")
    table.verify_code_object()


def test_package_builds_only_the_head_dims_named(matrix, tmp_path, monkeypatch, capsys):
    """`package --family gcn4 --head-dims 64`: the family's targets, narrowed as `build --head-dims`
    narrows them, are what is built and packed; a head_dim they do not build is refused by name."""
    seen = {}

    def fake_build(m, targets, build_dir, **kw):
        seen["build"] = (targets, build_dir)
        seen["specs"] = [spec.name for spec in m.specs_for(targets[0])]

    def fake_wheel(name, targets, build_dir, out_dir):
        seen["wheel"] = (name, targets)
        wheel = out_dir / "w.whl"
        wheel.write_bytes(b"")
        return wheel

    monkeypatch.setattr(cli.build, "build", fake_build)
    monkeypatch.setattr(cli.packaging, "kernel_wheel", fake_wheel)
    args = ["package", "--family", "gcn4", "--build-dir", str(tmp_path / "b"), "--out", str(tmp_path)]
    assert cli.main(args + ["--head-dims", "64"]) == 0
    (built,), build_dir = seen["build"]
    assert seen["wheel"] == ("gcn4", [built]) and build_dir == tmp_path / "b"
    whole = matrix.target("gfx803")
    assert built.name == "gfx803" and dict(built.head_dims)["f16"] == (64,) != dict(whole.head_dims).get("f16")
    # every kernel of one head_dim is head_dim 64's; the append kernels, which take any, stay
    assert all("_hd64_" in n for n in seen["specs"] if "_hd" in n)
    assert any(n.startswith("fa2_append_") for n in seen["specs"])
    assert cli.main(args + ["--head-dims", "65"]) == 2
    assert "head_dim 65: gfx803 builds none of its kernels there" in capsys.readouterr().err


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)


def test_without_torch_the_api_says_which_torch_to_install():
    out = _python("""
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        import rdnattention
        from rdnattention.families import f16  # the generator's view: layouts and names, no torch
        print("digest", f16.ARGS.digest)
        try:
            from rdnattention import flash_attn
        except ImportError as e:
            print("ImportError:", e)
        """)
    assert out.returncode == 0, out.stderr
    assert "digest " in out.stdout
    assert "ImportError: rdnattention needs PyTorch >= 2.4, and it cannot be imported" in out.stdout
    assert "pip install torch --index-url https://download.pytorch.org/whl/rocm" in out.stdout


def test_a_torch_too_old_is_named(monkeypatch):
    import torch

    from rdnattention import _torch
    monkeypatch.setattr(torch, "__version__", "2.3.1+rocm6.0")
    assert _torch.problem().startswith("rdnattention needs PyTorch >= 2.4, found 2.3.1+rocm6.0")


def test_the_command_without_torch_is_one_error_line():
    out = _python("""
        import sys
        sys.modules["torch"] = None
        from rdnattention.__main__ import main
        sys.exit(main(["info"]))
        """)
    assert out.returncode == 2 and out.stderr.startswith("rdnattention: error: rdnattention needs PyTorch")
    assert "Traceback" not in out.stderr


def test_the_generator_imports_no_torch():
    out = _python("""
        import sys
        import rdnattention_gen.build, rdnattention_gen.cli, rdnattention_gen.packaging
        print("torch" in sys.modules)
        """)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_an_installed_runtime_suggests_a_wheel_or_a_user_build(monkeypatch, tmp_path):
    from rdnattention.errors import KernelsNotBuiltError
    monkeypatch.setattr(dispatch, "_in_checkout", lambda: False)
    monkeypatch.setattr(dispatch, "search_path", lambda: [tmp_path])
    dispatch.table_for.cache_clear()
    try:
        with pytest.raises(KernelsNotBuiltError, match="install the rdnattention-kernels wheel that carries gfx1013 "
                                                       r".*rdnattention-gen build --user --targets gfx1013"):
            dispatch.table_for("gfx1013")
    finally:
        dispatch.table_for.cache_clear()
