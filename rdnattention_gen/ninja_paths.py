"""Paths in build.ninja. A path in a build statement is escaped for ninja; a path that a rule's
command substitutes through a variable ($clang, $inc_dir, $ptxas) is quoted for the shell, then
escaped for ninja. Ninja quotes $in and $out for the shell itself. So a checkout or build
directory named ``a b$c;touch x`` builds like any other and runs nothing but the compiler."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import ninja


class NinjaPathError(ValueError):
    """A path that build.ninja cannot hold; the message names it."""


def _checked(path: str | Path, forbidden: str) -> str:
    text = str(path)
    bad = sorted({c for c in text if c in forbidden})
    if bad:
        raise NinjaPathError(f"{text!r}: build.ninja cannot hold a path containing "
                             f"{' or '.join(map(repr, bad))}; use another directory")
    return text


def build_path(path: str | Path) -> str:
    """``path`` as written in a build statement. '|' ends a path there, with no escape."""
    return _checked(path, "\n\r|").replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def command_path(path: str | Path) -> str:
    """``path`` as the value of a variable a command substitutes: one shell word. Its spaces are
    escaped too, though a value needs it not: the writer wraps long lines at unescaped spaces, and
    ninja drops the spaces that begin a continuation line, so "a  b" could come back as "a b"."""
    return shlex.quote(_checked(path, "\n\r")).replace("$", "$$").replace(" ", "$ ")


# What ninja's depfile reader takes in a path as clang writes it (clang escapes ' ', '#' and '$').
# Other characters (';' and '`' among them) end the path there in some or all ninja versions, and
# the edge would look dirty on every build; a rule whose paths hold one lists its headers instead.
_DEPFILE_SAFE = re.compile(r"[A-Za-z0-9+,/_.~()@=!# $-]*")


def depfile_safe(*paths: str | Path) -> bool:
    return all(_DEPFILE_SAFE.fullmatch(str(p)) for p in paths)


class Writer(ninja.Writer):
    """ninja.Writer whose build statements escape every '$' of a path: ninja_syntax.escape_path
    escapes only '$ ', so the path ``a$b`` would read as ``a`` plus the variable ``b``."""

    def build(self, outputs: str | list[str], rule: str, inputs: str | list[str] | None = None,
              implicit: list[str] | None = None, variables: dict[str, str] | None = None) -> None:
        words = [build_path(p) for p in _as_list(inputs)]
        if implicit:
            words += ["|"] + [build_path(p) for p in implicit]
        self._line(f"build {' '.join(build_path(p) for p in _as_list(outputs))}: {' '.join([rule] + words)}")
        for key, value in (variables or {}).items():
            self.variable(key, value, indent=1)


def _as_list(paths: str | list[str] | None) -> list[str]:
    if paths is None:
        return []
    return [paths] if isinstance(paths, str) else list(paths)
