"""Kernel-argument structs. The runtime owns them: each kernel family declares its struct here
(as data), the generator renders the same fields into C, and every dispatch table records the
layout digest its code objects were built with, so a runtime never launches a kernel whose
argument layout it does not share."""

from __future__ import annotations

import ctypes
import functools
import hashlib
from dataclasses import dataclass

# C type (as the templates spell it) -> ctypes type. Device and host agree on these sizes and
# alignments (LP64 host, 64-bit device pointers).
C_TYPES: dict[str, type] = {
    "const half_t*": ctypes.c_void_p,
    "half_t*": ctypes.c_void_p,
    "const float*": ctypes.c_void_p,
    "float*": ctypes.c_void_p,
    "const int*": ctypes.c_void_p,
    "int*": ctypes.c_void_p,
    "unsigned*": ctypes.c_void_p,
    "const signed char*": ctypes.c_void_p,
    "signed char*": ctypes.c_void_p,
    "long long": ctypes.c_longlong,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
}


@dataclass(frozen=True)
class ArgStruct:
    """One kernel-argument struct: its C name and its fields ``(name, C type)`` in order."""

    name: str
    fields: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        unknown = sorted({c for _, c in self.fields} - set(C_TYPES))
        if unknown:
            raise TypeError(f"{self.name}: C types without a ctypes mapping: {', '.join(unknown)}")
        names = [n for n, _ in self.fields]
        if len(set(names)) != len(names):
            raise TypeError(f"{self.name}: duplicate field names")

    @functools.cached_property
    def ctype(self) -> type[ctypes.Structure]:
        return type(self.name, (ctypes.Structure,), {"_fields_": [(n, C_TYPES[c]) for n, c in self.fields]})

    @functools.cached_property
    def digest(self) -> str:
        """Hash of the layout: struct name, and every field's name, C type, offset and size."""
        st = self.ctype
        lines = [self.name, str(ctypes.sizeof(st))]
        lines += [f"{n} {c} {getattr(st, n).offset} {getattr(st, n).size}" for n, c in self.fields]
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
