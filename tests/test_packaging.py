"""Distributions: which targets each carries (README's table follows the matrix), the kernel wheel
a maintainer builds, and the runtime's lookup through installed kernel distributions."""

import re
import zipfile

import pytest
from conftest import REPO_ROOT

from rdnattention import dispatch
from rdnattention_gen import packaging


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
