"""One compile for the targets of one instruction set: clang compiles the kernels of the first
target to assembly, and every target of that set (variants.yaml's ``isa``) assembles its code object
from it. build.py groups targets only where their generated sources are the same but for their
names, so the assembly is what clang would write for each of them but for the two lines that name
the target (the ``.amdgcn_target`` directive and the metadata's ``amdhsa.target``). Those are
rewritten here; the assembler then checks every instruction against the target's own ISA, and the
audit reads each code object as it reads a compiled one (comgr's ISA name included).

Run by ninja: ``python -m rdnattention_gen.assemble --clang CLANG --source gfx1030 --target gfx1031
--code-object-version 4 IN.s OUT.hsaco``."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

TRIPLE = "amdgcn-amd-amdhsa"


class RetargetError(ValueError):
    """The assembly does not name its target the way clang writes it; the message says what is missing."""


def retarget(text: str, source: str, target: str) -> str:
    """``text`` (clang's assembly for ``source``) naming ``target`` instead: exactly one
    ``.amdgcn_target`` directive and one ``amdhsa.target`` metadata entry, each naming ``source``
    with no feature suffix, or RetargetError."""
    if source == target:
        return text
    for what, pattern in ((".amdgcn_target directive", rf'^(\s*\.amdgcn_target\s+"){TRIPLE}--{source}(")\s*$'),
                          ("amdhsa.target metadata entry", rf"^(\s*amdhsa\.target:\s+'?){TRIPLE}--{source}('?)\s*$")):
        text, n = re.subn(pattern, rf"\g<1>{TRIPLE}--{target}\g<2>", text, flags=re.MULTILINE)
        if n != 1:
            raise RetargetError(f"expected one {what} naming {TRIPLE}--{source}, found {n}")
    return text


def assemble(clang: str, source: str, target: str, code_object_version: int, assembly: Path, out: Path) -> None:
    """Assembles and links ``out`` for ``target`` from ``assembly`` (written for ``source``)."""
    text = retarget(assembly.read_text(), source, target)
    cmd = [clang, "-target", TRIPLE, f"-mcpu={target}", f"-mcode-object-version={code_object_version}",
           "-x", "assembler", "-", "-o", str(out)]
    proc = subprocess.run(cmd, input=text, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"assembling {assembly} for {target} failed (exit {proc.returncode}); the assembler's "
                         "output is above")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rdnattention_gen.assemble", description=__doc__.split("\n\n")[0])
    p.add_argument("--clang", required=True)
    p.add_argument("--source", required=True, help="the target the assembly was compiled for")
    p.add_argument("--target", required=True, help="the target to assemble the code object for")
    p.add_argument("--code-object-version", type=int, required=True)
    p.add_argument("assembly", type=Path)
    p.add_argument("out", type=Path)
    a = p.parse_args(argv)
    try:
        assemble(a.clang, a.source, a.target, a.code_object_version, a.assembly, a.out)
    except RetargetError as e:
        print(f"{a.assembly}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
