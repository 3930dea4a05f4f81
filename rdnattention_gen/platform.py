"""What a platform is to the generator: how its targets are named and validated, how their sources
are compiled (ninja rules), what the code object is called, and how its resources are audited.
One module per platform under platforms/; nothing else branches on a platform's name."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import ninja

from .kernel_audit import KernelAudit
from .spec import KernelSpec
from .strict_yaml import Node
from .target import Target
from .toolchain import Toolchain

# Always optimised: unoptimised builds of the V path are known to race (see docs/hardware.md).
DEVICE_FLAGS = "-O3 -std=c++17 -fno-strict-aliasing -Wall -Werror=return-type"


class Platform:
    name: str
    description: str
    code_object: str               # file name of a target's code object in build/<target>/
    code_object_version: int | None = None  # the ABI version its code objects are built for (None: no such pin)
    target_prefix: str             # every target of this platform is named <prefix>...
    target_names: str              # how to say it in an error
    dynamic_lds: bool = False      # LDS is sized at launch rather than in the code object
    int8_dots: tuple[str, ...]     # the int8 dot instructions its targets may claim
    instructions: dict[str, str]   # audit count -> the instruction as this platform spells it
    audit_version = 1              # bumped when the audit reader changes what it reports (cache key)
    mirrors = False                # its targets may build other targets' tiles (`mirrors:`)
    chained = False                # a code object comes of two long steps in a row (build.py starts it first)

    @property
    def prelude(self) -> str:
        return f"prelude_{self.name}.h.j2"

    def validate_target(self, name: str, fields: dict, node: Node) -> None:
        """Platform rules on a target entry (beyond the common ones); raise node.fail(...)."""
        if not name.startswith(self.target_prefix):
            raise node.fail("platform", f"{self.name} targets are named {self.target_names}")
        if fields["mirrors"] and not self.mirrors:
            raise node.fail("mirrors", f"only host targets mirror other targets' tiles, not {self.name} ones")

    def unavailable(self, target: Target) -> str | None:
        """Why ``target`` cannot be built on this machine, or None."""
        return None

    def code_object_path(self, target: Target, build_dir: Path) -> Path:
        return build_dir / target.name / self.code_object

    def ninja_rules(self, w: ninja.Writer) -> None:
        raise NotImplementedError

    # Whether targets of one instruction set may share one compile (build.py's _shared_compiles):
    # ninja_build then gets the target compiled (``source``) and the targets sharing it.
    shares_compiles = False

    def ninja_build(self, w: ninja.Writer, target: Target, specs: list[KernelSpec], gen_dir: Path,
                    out_dir: Path, stamp: str, headers: list[str], source: Target | None = None,
                    shared: tuple[str, ...] = ()) -> None:
        """Build statements for one target: ``gen_dir/kernels.cpp`` (which includes every kernel)
        to ``out_dir/<code_object>``. A rebuild follows ``stamp`` (the toolchain identity) and the
        generated ``headers``, where the compiler writes no depfile. ``source``: where the platform
        shares compiles, the target whose compile this one's code object comes from (itself for the
        one compiled; None where it compiles alone); ``shared``: the names of the targets sharing it."""
        raise NotImplementedError

    def audit(self, tc: Toolchain, target: Target, specs: list[KernelSpec], build_dir: Path) -> list[KernelAudit]:
        raise NotImplementedError

    def shared_reads(self) -> AbstractContextManager:
        """Within it, audits of targets whose code objects hold the same machine code (a shared
        compile) may read it once (amdgcn: the disassembly); nothing is kept past it."""
        return nullcontext()

    def launch_violations(self, target: Target, spec: KernelSpec, row: KernelAudit) -> list[str]:
        """Where the built kernel's launch ABI differs from what the runtime passes (one line each);
        a platform that does not read its launch ABI reports nothing."""
        return []
