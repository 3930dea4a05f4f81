"""Kernels into distributions. The main wheel (``rdnattention``) carries the default targets' code
objects and dispatch tables in ``rdnattention/lib/`` (setup.py's build step calls pack); a kernel
wheel (``rdnattention-kernels-<name>``) carries more targets, and the runtime finds it through the
``rdnattention.kernels`` entry-point group. Both hold only what the runtime loads: per target,
dispatch.json and the code object it names, checked against the size and SHA-256 the table records."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from rdnattention.dispatch import ENTRY_POINT_GROUP

from . import __version__
from .matrix import Matrix
from .target import Target

_NAME = re.compile(r"[a-z0-9][a-z0-9.]*")


class PackagingError(RuntimeError):
    """A distribution could not be made; the message says why."""


def distributions(matrix: Matrix) -> dict[str, str]:
    """Each distribution and its targets (comma list): ``rdnattention`` carries the default targets,
    ``rdnattention-kernels-<family>`` a family's opt-in GPU targets."""
    gpu = [t for t in matrix.targets if t.platform != "host"]
    out = {"rdnattention": ", ".join(sorted(t.name for t in gpu if t.default))}
    for family in sorted({t.family for t in gpu if not t.default}):
        out[f"rdnattention-kernels-{family}"] = ", ".join(sorted(t.name for t in gpu
                                                                 if t.family == family and not t.default))
    return out


def pack(targets: list[Target], build_dir: Path, dest: Path) -> list[Path]:
    """Copies each built target's dispatch.json and code object into ``dest/<target>/``."""
    written = []
    for target in targets:
        table_path = build_dir / target.name / "dispatch.json"
        if not table_path.is_file():
            raise PackagingError(f"{table_path} does not exist; build {target.name} first")
        table = json.loads(table_path.read_text())
        code_object = build_dir / target.name / table["code_object"]
        data = code_object.read_bytes()
        if len(data) != table["code_object_bytes"] or hashlib.sha256(data).hexdigest() != table["code_object_sha256"]:
            raise PackagingError(f"{code_object} is not the code object {table_path} was written for; rebuild "
                                 f"{target.name}")
        out = dest / target.name
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(table_path, out / "dispatch.json")
        shutil.copyfile(code_object, out / table["code_object"])
        written += [out / "dispatch.json", out / table["code_object"]]
    return written


def refuse_host(targets: list[Target]) -> None:
    """Wheels are pure Python: a host target (a shared library of this machine) never goes into one."""
    host = [t.name for t in targets if t.platform == "host"]
    if host:
        raise PackagingError(f"{', '.join(host)}: host targets are built on the machine that runs them "
                             "(rdnattention-gen build --user --targets host), never packed into a wheel")


def kernel_wheel(name: str, targets: list[Target], build_dir: Path, out_dir: Path) -> Path:
    """Builds ``rdnattention-kernels-<name>`` (py3-none-any) holding the built ``targets``, requiring
    this version of rdnattention; returns the wheel's path. Uses pip and setuptools (fetched into
    pip's isolated build environment)."""
    if not _NAME.fullmatch(name):
        raise PackagingError(f"distribution name {name!r}: use lower-case letters, digits and dots")
    if not targets:
        raise PackagingError(f"no targets for rdnattention-kernels-{name}")
    refuse_host(targets)
    package = "rdnattention_kernels_" + name.replace(".", "_")
    with tempfile.TemporaryDirectory(prefix="rdnattention-kernels-") as tmp:
        project = Path(tmp)
        pack(targets, build_dir, project / package)
        listed = ", ".join(t.name for t in targets)
        (project / package / "__init__.py").write_text(
            f'"""Prebuilt rdnattention kernels: {listed}. Data only; rdnattention finds them through '
            f'the {ENTRY_POINT_GROUP} entry point."""\n')
        (project / "pyproject.toml").write_text(textwrap.dedent(f"""\
            [build-system]
            requires = ["setuptools>=77"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "rdnattention-kernels-{name}"
            version = "{__version__}"
            description = "Prebuilt rdnattention kernels for {listed}"
            license = "MIT"
            requires-python = ">=3.10"
            dependencies = ["rdnattention=={__version__}"]

            [project.entry-points."{ENTRY_POINT_GROUP}"]
            {name.replace(".", "_")} = "{package}"

            [tool.setuptools]
            packages = ["{package}"]

            [tool.setuptools.package-data]
            {package} = ["*/*"]
            """))
        out_dir = out_dir.resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out_dir), str(project)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise PackagingError(f"pip wheel failed for rdnattention-kernels-{name}:\n{proc.stdout}{proc.stderr}")
    wheel = out_dir / f"{package}-{__version__}-py3-none-any.whl"  # the normalised name pip writes
    if not wheel.is_file():
        raise PackagingError(f"pip wheel wrote no {wheel.name} into {out_dir}")
    return wheel
