"""The wheel's build step: besides the Python packages, build_py generates, compiles and audits the
kernels of $RDNATTENTION_WHEEL_TARGETS (default: the default targets) with this source tree's
generator and packs their code objects and dispatch tables into rdnattention/lib/. The
toolchain (clang-22, lld-22, llvm-22) must be installed; an editable install packs nothing (the
checkout's build/ is on the runtime's search path). Metadata is in pyproject.toml."""

from __future__ import annotations

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
        print(f"rdnattention: building kernels for {', '.join(t.name for t in targets)} in {build_dir}", flush=True)
        build.build(matrix, targets, build_dir)  # audits every target it packs
        packaging.pack(targets, build_dir.resolve(), Path(self.build_lib) / "rdnattention" / "lib")


# setuptools' own build tree goes beside, not into, build/ (the generator's kernel build directory).
setup(cmdclass={"build_py": BuildPyWithKernels}, options={"build": {"build_base": ".build-wheel"}})
