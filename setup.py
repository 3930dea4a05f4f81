"""The wheel's build step: besides the Python packages, build_py generates, compiles and audits the
kernels of $RDNATTENTION_WHEEL_TARGETS (default: the default targets) with this source tree's
generator and packs their code objects and dispatch tables into rdnattention/lib/. The
toolchain (clang-22, lld-22, llvm-22) must be installed; an editable install packs nothing (the
checkout's build/ is on the runtime's search path). Metadata is in pyproject.toml.

pip shows a build backend's output only with -v; so that ``pip wheel .`` shows how far the kernel
build is without it, a progress bar (tqdm) is drawn on the controlling terminal where there is one
and the build's own output does not reach it. Without a terminal (CI, logs) nothing extra is
written."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        sys.path.insert(0, str(ROOT))  # this tree's generator (and the runtime's shared modules)
        from rdnattention_gen import build, packaging
        from rdnattention_gen.matrix import load_matrix

        matrix = load_matrix()
        targets = matrix.select(os.environ.get("RDNATTENTION_WHEEL_TARGETS", "default"))
        packaging.refuse_host(targets)
        build_temp = self.get_finalized_command("build").build_temp
        build_dir = Path(os.environ.get("RDNATTENTION_WHEEL_BUILD_DIR") or Path(build_temp) / "kernels")
        what = f"building kernels for {', '.join(t.name for t in targets)} in {build_dir}"
        print(f"rdnattention: {what}", flush=True)
        with _terminal_progress(what) as progress:
            build.build(matrix, targets, build_dir, progress=progress)  # audits every target it packs
        packaging.pack(targets, build_dir.resolve(), Path(self.build_lib) / "rdnattention" / "lib")


@contextlib.contextmanager
def _terminal_progress(what: str):
    """A tqdm bar on the controlling terminal while stdout is captured (pip without -v), else None."""
    if sys.stdout.isatty():
        yield None  # the build's own lines (ninja's [done/total]) reach the terminal
        return
    try:
        tty = open("/dev/tty", "w")  # noqa: SIM115 - closed below
    except OSError:  # no controlling terminal: CI, a service, a log
        yield None
        return
    from tqdm import tqdm

    with tty:
        tty.write(f"rdnattention: {what} (pip shows the compiler's output with -v)\n")
        try:
            columns = os.get_terminal_size(tty.fileno()).columns
        except OSError:
            columns = 0
        with tqdm(total=0, desc="rdnattention: compiling", unit="step", file=tty, ncols=columns or 80) as bar:
            yield bar


# setuptools' own build tree goes beside, not into, build/ (the generator's kernel build directory).
setup(cmdclass={"build_py": BuildPyWithKernels}, options={"build": {"build_base": ".build-wheel"}})
