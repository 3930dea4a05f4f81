"""ROCm's code object manager (libamd_comgr) through ctypes: the ISA it reads from a code object.
hipModuleLoadData asks comgr for exactly this before it loads anything, so a code object this comgr
refuses is one that the HIP of the same ROCm refuses to load (comgr 5.2 reads code objects v3 and
v4 only; ROCm 5.3 added v5). Debian 12's libamd-comgr2 is comgr 5.2.3, installed beside
libamdhip64-5, so the build and CI check every AMD code object against it on the CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass

# amd_comgr.h (interface 2.x, e.g. Debian's libamd-comgr-dev 5.2.3): amd_comgr_data_kind_t and
# amd_comgr_status_t.
DATA_KIND_EXECUTABLE = 0x8
STATUS = {0: "AMD_COMGR_STATUS_SUCCESS", 1: "AMD_COMGR_STATUS_ERROR",
          2: "AMD_COMGR_STATUS_ERROR_INVALID_ARGUMENT", 3: "AMD_COMGR_STATUS_ERROR_OUT_OF_RESOURCES"}


class ComgrError(RuntimeError):
    """A comgr call returned a status other than success; ``status`` is that number."""

    def __init__(self, call: str, status: int):
        super().__init__(f"{call} returned {status} ({STATUS.get(status, 'unknown status')})")
        self.call, self.status = call, status


class _Data(ctypes.Structure):  # amd_comgr_data_t: a handle
    _fields_ = [("handle", ctypes.c_uint64)]


@dataclass(frozen=True)
class Comgr:
    """One loaded libamd_comgr."""

    path: str
    lib: ctypes.CDLL

    @property
    def version(self) -> tuple[int, int]:
        """The interface version (2.4 is ROCm 5.2's comgr)."""
        major, minor = ctypes.c_size_t(), ctypes.c_size_t()
        self.lib.amd_comgr_get_version(ctypes.byref(major), ctypes.byref(minor))
        return major.value, minor.value

    def __str__(self) -> str:
        return f"{self.path} (comgr interface {'.'.join(map(str, self.version))})"

    @functools.cached_property
    def isas(self) -> tuple[str, ...]:
        """Every ISA this comgr knows (comgr 5.2.3: gfx600 to gfx1036; nothing of RDNA3 or later)."""
        count = ctypes.c_size_t()
        self._call("amd_comgr_get_isa_count", ctypes.byref(count))
        names = []
        for i in range(count.value):
            name = ctypes.c_char_p()
            self._call("amd_comgr_get_isa_name", i, ctypes.byref(name))
            names.append(name.value.decode())
        return tuple(names)

    def _call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status:
            raise ComgrError(name, status)

    def isa_name(self, code_object: bytes) -> str:
        """The ISA comgr reads from an executable code object, e.g. amdgcn-amd-amdhsa--gfx1030."""
        data = _Data()
        self._call("amd_comgr_create_data", DATA_KIND_EXECUTABLE, ctypes.byref(data))
        try:
            self._call("amd_comgr_set_data", data, len(code_object), code_object)
            size = ctypes.c_size_t(0)
            self._call("amd_comgr_get_data_isa_name", data, ctypes.byref(size), None)
            name = ctypes.create_string_buffer(size.value)
            self._call("amd_comgr_get_data_isa_name", data, ctypes.byref(size), name)
        finally:
            self.lib.amd_comgr_release_data(data)
        return name.value.decode()


@functools.lru_cache(maxsize=None)
def find() -> Comgr | None:
    """The system's libamd_comgr (the one the system's HIP runtime uses), or None where there is none."""
    path = ctypes.util.find_library("amd_comgr")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        _bind(lib)
    except (OSError, AttributeError):  # not loadable, or a comgr without these calls
        return None
    return Comgr(path, lib)


def _bind(lib: ctypes.CDLL) -> None:
    status = ctypes.c_int
    lib.amd_comgr_create_data.argtypes = [ctypes.c_int, ctypes.POINTER(_Data)]
    lib.amd_comgr_set_data.argtypes = [_Data, ctypes.c_size_t, ctypes.c_char_p]
    lib.amd_comgr_get_data_isa_name.argtypes = [_Data, ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p]
    lib.amd_comgr_release_data.argtypes = [_Data]
    lib.amd_comgr_get_isa_count.argtypes = [ctypes.POINTER(ctypes.c_size_t)]
    lib.amd_comgr_get_isa_name.argtypes = [ctypes.c_size_t, ctypes.POINTER(ctypes.c_char_p)]
    for f in (lib.amd_comgr_create_data, lib.amd_comgr_set_data, lib.amd_comgr_get_data_isa_name,
              lib.amd_comgr_release_data, lib.amd_comgr_get_isa_count, lib.amd_comgr_get_isa_name):
        f.restype = status
    lib.amd_comgr_get_version.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2
    lib.amd_comgr_get_version.restype = None
