"""ctypes mirror of the kernel-argument struct defined in rdnattention_gen.abi."""

from __future__ import annotations

import ctypes

from rdnattention_gen.abi import FA2_ARGS

_CTYPES = {
    "const half_t*": ctypes.c_void_p,
    "half_t*": ctypes.c_void_p,
    "float*": ctypes.c_void_p,
    "const float*": ctypes.c_void_p,
    "long long": ctypes.c_longlong,
    "int": ctypes.c_int,
    "float": ctypes.c_float,
}


class Fa2Args(ctypes.Structure):
    _fields_ = [(name, _CTYPES[ctype]) for name, ctype in FA2_ARGS]
