"""Render kernel sources from the templates: deterministic, write-if-changed.

Per target: ``prelude.h`` (the platform's intrinsics layer), one ``args_<family>.h`` per family
(the runtime's argument struct in C), one ``<kernel>.cpp`` per kernel and ``kernels.cpp``, the
single translation unit that includes them all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jinja2

from . import TEMPLATES
from .families import FAMILIES, family
from .matrix import Matrix
from .platforms import platform
from .spec import KernelSpec
from .target import Target


def environment(templates: Path = TEMPLATES) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_if_changed(path: Path, text: str) -> bool:
    """Write atomically, only when the content differs, so ninja sees no change otherwise."""
    data = text.encode()
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; generated files follow the umask like any other
    os.replace(tmp, path)
    return True


def render_prelude(env: jinja2.Environment, target: Target) -> str:
    return env.get_template(platform(target.platform).prelude).render(target=target)


def render_args(env: jinja2.Environment, family_name: str) -> str:
    return env.get_template("_args.h.j2").render(family=family(family_name), struct=family(family_name).args)


def render_kernel(env: jinja2.Environment, spec: KernelSpec) -> str:
    fam = family(spec.family)
    t = spec.tile
    # A tile with a register budget keeps that many waves per SIMD resident; otherwise the compiler chooses.
    attributes = f"RDNA_KERNEL_WAVES({t.threads}, {t.waves})" if t.waves else f"RDNA_KERNEL({t.threads})"
    return env.get_template(fam.template).render(spec=spec, family=fam, kernel_attributes=attributes,
                                                 **fam.context(spec))


def render_fma_peak(env: jinja2.Environment, target: Target) -> str:
    from rdnattention import peak

    return env.get_template("fma_peak.hip.j2").render(target=target, struct=peak.ARGS, kernel=peak.KERNEL,
                                                      threads=peak.THREADS, chains=peak.CHAINS, unroll=peak.UNROLL)


def render_unity(target: Target, specs: list[KernelSpec]) -> str:
    lines = [f"// @generated: every kernel of {target.name}, one translation unit, one code object"]
    lines += [f'#include "{s.name}.cpp"' for s in specs]
    lines.append('#include "fma_peak.cpp"  // the FP32 FMA peak probe (rdnattention/peak.py)')
    return "\n".join(lines) + "\n"


def target_files(env: jinja2.Environment, matrix: Matrix, target: Target) -> dict[str, str]:
    specs = matrix.specs_for(target)
    files = {"prelude.h": render_prelude(env, target), "kernels.cpp": render_unity(target, specs),
             "fma_peak.cpp": render_fma_peak(env, target)}
    # Every family whose struct a built family uses gets its header (families that share a struct
    # share its header).
    digests = {family(s.family).args.digest for s in specs}
    files.update({f"args_{name}.h": render_args(env, name) for name, fam in sorted(FAMILIES.items())
                  if fam.args.digest in digests})
    files.update({f"{s.name}.cpp": render_kernel(env, s) for s in specs})
    return files


def generate(matrix: Matrix, targets: list[Target], gen_dir: Path) -> tuple[int, int]:
    """Render every source of ``targets`` under ``gen_dir/<target>/``; returns (written, total)."""
    env = environment()
    written = total = 0
    for target in targets:
        out = gen_dir / target.name
        files = target_files(env, matrix, target)
        for name in sorted(files):
            written += write_if_changed(out / name, files[name])
            total += 1
        stale = {p.name for p in out.iterdir() if p.is_file()} - set(files)
        for name in sorted(stale):
            (out / name).unlink()
    return written, total
