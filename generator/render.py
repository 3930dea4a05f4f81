"""Render kernel sources from the templates: deterministic, write-if-changed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jinja2

from .abi import FA2_ARGS
from .matrix import REPO_ROOT, KernelSpec, Matrix, Target

TEMPLATES = REPO_ROOT / "templates"
INCLUDE_DIR = TEMPLATES / "include"
HOST_DIR = TEMPLATES / "host"


def environment(templates: Path = TEMPLATES) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def write_if_changed(path: Path, text: str) -> bool:
    """Write atomically, only when the content differs, so ninja sees no change otherwise."""
    data = text.encode()
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return True


def render_prelude(env: jinja2.Environment, target: Target) -> str:
    return env.get_template(f"prelude_{target.platform}.h.j2").render(target=target, fa2_args=FA2_ARGS)


def render_kernel(env: jinja2.Environment, matrix: Matrix, spec: KernelSpec) -> str:
    template = matrix.kernel_kind(spec.kind).template
    return env.get_template(template).render(spec=spec)


def render_unity(target: Target, specs: list[KernelSpec]) -> str:
    lines = [f"// @generated: every kernel of {target.name}, one translation unit, one code object"]
    lines += [f'#include "{s.name}.cpp"' for s in specs]
    return "\n".join(lines) + "\n"


def generate(matrix: Matrix, targets: list[Target], gen_dir: Path) -> tuple[int, int]:
    """Render every source of ``targets`` under ``gen_dir/<target>/``; returns (written, total)."""
    env = environment()
    written = total = 0
    for target in targets:
        out = gen_dir / target.name
        specs = matrix.specs_for(target)
        files = {"prelude.h": render_prelude(env, target), "kernels.cpp": render_unity(target, specs)}
        files.update({f"{s.name}.cpp": render_kernel(env, matrix, s) for s in specs})
        for name in sorted(files):
            written += write_if_changed(out / name, files[name])
            total += 1
        stale = {p.name for p in out.iterdir() if p.is_file()} - set(files)
        for name in sorted(stale):
            (out / name).unlink()
    return written, total
