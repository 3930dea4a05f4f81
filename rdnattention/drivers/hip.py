"""The HIP driver (platform amdgcn): HSA code objects loaded through ctypes on the HIP runtime
(libamdhip64 on Linux, amdhip64*.dll on Windows) that ROCm torch already has in the process (the
same runtime and context: a second copy of the library fails at launch), launched on torch's
current stream.

Target resolution: RDNATTENTION_TARGET if set, else HSA_OVERRIDE_GFX_VERSION as ROCm reads it
(10.3.0 -> gfx1030), else the device's gcnArchName without its feature suffix
(gfx1030:sramecc-:xnack- -> gfx1030)."""

from __future__ import annotations

import ctypes.util
import functools
import glob
import ntpath
import os
import posixpath
import re
import sys
from pathlib import Path

import torch

from ..errors import LaunchError, UnsupportedError
from .module_api import ModuleApi, ModuleDriver, current_device

PLATFORM = "amdgcn"
API = ModuleApi(vendor="HIP", load="hipModuleLoadData", get_function="hipModuleGetFunction",
                launch="hipModuleLaunchKernel", error_string="hipGetErrorString", error_string_returns=True,
                occupancy="hipModuleOccupancyMaxActiveBlocksPerMultiprocessor",
                set_attribute=None, max_dynamic_shared=0)  # amdgcn kernels allocate their LDS statically
LIBRARY_ENV = "RDNATTENTION_HIP_LIBRARY"
_ARCH = re.compile(r"gfx[0-9]{1,2}[0-9a-f]{2}")


def serves(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is not None


def parse_arch(gcn_arch_name: str) -> str:
    """gcnArchName without its feature flags: "gfx1030:sramecc-:xnack-" -> "gfx1030"."""
    arch = gcn_arch_name.split(":", 1)[0].strip()
    if not _ARCH.fullmatch(arch):
        raise UnsupportedError(f"cannot read a gfx target from the device's gcnArchName {gcn_arch_name!r}; "
                               "set RDNATTENTION_TARGET=gfxNNNN to name it")
    return arch


def override_arch(value: str) -> str:
    """HSA_OVERRIDE_GFX_VERSION as ROCm reads it: major.minor.stepping, the last two as hex digits
    of the gfx name (10.3.0 -> gfx1030, 9.0.6 -> gfx906, 9.0.12 -> gfx90c, 11.0.0 -> gfx1100)."""
    m = re.fullmatch(r"\s*(\d+)\.(\d+)\.(\d+)\s*", value)
    if not m or int(m[2]) > 15 or int(m[3]) > 15:
        raise UnsupportedError(f"HSA_OVERRIDE_GFX_VERSION={value!r} is not major.minor.stepping "
                               "(minor and stepping 0-15), e.g. 10.3.0")
    return f"gfx{int(m[1])}{int(m[2]):x}{int(m[3]):x}"


@functools.lru_cache(maxsize=None)
def _device_arch(index: int) -> str:
    return parse_arch(torch.cuda.get_device_properties(index).gcnArchName)


def target(device: torch.device) -> str:
    override = os.environ.get("HSA_OVERRIDE_GFX_VERSION")
    if override:
        return override_arch(override)
    return _device_arch(device.index if device.index is not None else current_device())


# The runtime's file names: libamdhip64.so with any version suffix on Linux; on Windows (HIP SDK,
# torch's ROCm wheels) amdhip64.dll (5.x) or amdhip64_<major>.dll (6.x, 7.x), in any letter case.
# Another DLL whose name merely starts with amdhip64 is not the runtime: counted as one, it would
# be refused as a second copy.
_LINUX_RUNTIME = re.compile(r"libamdhip64\.so.*")
_WINDOWS_RUNTIME = re.compile(r"amdhip64(_\d+)?\.dll", re.IGNORECASE)
_WINDOWS = "win32"  # sys.platform's spelling


def is_runtime(path: str, platform: str = sys.platform) -> bool:
    """Whether ``path`` names a HIP runtime library on ``platform`` (a sys.platform value)."""
    if platform == _WINDOWS:
        return _WINDOWS_RUNTIME.fullmatch(ntpath.basename(path)) is not None
    return _LINUX_RUNTIME.fullmatch(posixpath.basename(path)) is not None


def _linux_mappings() -> list[str]:
    """The path of every file mapped into this process (/proc/self/maps), in order, repeats included."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(None, 5) for line in maps]
    except OSError:
        return []
    return [f[5].strip() for f in fields if len(f) == 6]  # address, perms, offset, dev, inode, path


def _windows_modules() -> list[str]:
    """The path of every module (DLL) loaded into this process, from kernel32's module list. Not
    run in CI (nothing Windows runs there): tests give library_path a fake module list instead."""
    from ctypes import wintypes

    kernel32 = ctypes.WinDLL("kernel32")  # our own instance: windll's is shared, and so are its argtypes
    kernel32.GetCurrentProcess.restype = wintypes.HANDLE
    kernel32.K32EnumProcessModules.argtypes = [wintypes.HANDLE, ctypes.POINTER(wintypes.HMODULE), wintypes.DWORD,
                                               ctypes.POINTER(wintypes.DWORD)]
    kernel32.GetModuleFileNameW.argtypes = [wintypes.HMODULE, wintypes.LPWSTR, wintypes.DWORD]
    process, needed = kernel32.GetCurrentProcess(), wintypes.DWORD()
    handles = (wintypes.HMODULE * 256)()
    while True:  # modules loaded meanwhile grow the list: ask again with room for them
        if not kernel32.K32EnumProcessModules(process, handles, ctypes.sizeof(handles), ctypes.byref(needed)):
            return []
        if needed.value <= ctypes.sizeof(handles):
            break
        handles = (wintypes.HMODULE * (needed.value // ctypes.sizeof(wintypes.HMODULE)))()
    name = ctypes.create_unicode_buffer(32768)  # the longest path Windows has
    paths = []
    for handle in handles[:needed.value // ctypes.sizeof(wintypes.HMODULE)]:
        if kernel32.GetModuleFileNameW(handle, name, len(name)):
            paths.append(name.value)
    return paths


def loaded_modules(platform: str = sys.platform) -> list[str]:
    """The shared libraries loaded into this process, by path, as ``platform``'s loader lists them."""
    return _windows_modules() if platform == _WINDOWS else _linux_mappings()


def runtimes(paths: list[str], platform: str = sys.platform) -> list[str]:
    """The HIP runtimes among ``paths``, each once, in order."""
    return list(dict.fromkeys(p for p in paths if is_runtime(p, platform)))


def mapped_libraries(platform: str = sys.platform) -> list[str]:
    """Every HIP runtime loaded into this process (torch's, once ROCm torch is initialised)."""
    return runtimes(loaded_modules(platform), platform)


def _search_dirs(platform: str) -> list[Path]:
    """The directories a runtime not loaded yet is looked for in, in order: torch's lib/ (where ROCm
    wheels ship it), then ROCm's $ROCM_PATH/lib; on Windows the HIP SDK's %HIP_PATH%\\bin, then
    every PATH directory (the system search: ctypes.util.find_library("amdhip64") searches PATH
    there too, but for amdhip64.dll alone, never amdhip64_6.dll)."""
    torch_lib = Path(torch.__file__).parent / "lib"
    if platform != _WINDOWS:
        return [torch_lib, Path(os.environ.get("ROCM_PATH", "/opt/rocm")) / "lib"]
    sdk = [Path(os.environ["HIP_PATH"]) / "bin"] if os.environ.get("HIP_PATH") else []
    return [torch_lib, *sdk, *(Path(d) for d in os.environ.get("PATH", "").split(os.pathsep) if d)]


def _candidates(platform: str) -> list[str]:
    """Every runtime not loaded yet that could be bound, in the order they are tried."""
    pattern = "amdhip64*.dll" if platform == _WINDOWS else "libamdhip64.so*"
    found = [p for d in _search_dirs(platform) for p in sorted(glob.glob(os.path.join(glob.escape(str(d)), pattern)))
             if is_runtime(p, platform)]
    system = None if platform == _WINDOWS else ctypes.util.find_library("amdhip64")  # Windows: PATH, above
    explicit = os.environ.get(LIBRARY_ENV)
    return found + [p for p in (system, explicit) if p]


def _same_file(a: str, b: str) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def library_path(platform: str = sys.platform) -> str:
    """The HIP runtime to bind: the copy already loaded (ROCm torch's), else the one torch ships,
    else ROCm's (Windows: the HIP SDK's), else the system's, else $RDNATTENTION_HIP_LIBRARY. Never
    a second copy. ``platform``: a sys.platform value; the Windows path is tested with a fake
    module list only (nothing Windows runs in CI)."""
    mapped = mapped_libraries(platform)
    explicit = os.environ.get(LIBRARY_ENV)
    if len(mapped) > 1:
        raise LaunchError(f"two HIP runtimes are mapped into this process ({', '.join(mapped)}); kernels launched "
                          "through one would not see the other's memory. Load only ROCm torch's")
    if mapped:
        if explicit and not _same_file(explicit, mapped[0]):
            raise LaunchError(f"{LIBRARY_ENV}={explicit} is not the HIP runtime this process already uses "
                              f"({mapped[0]}); a second copy fails at launch. Unset {LIBRARY_ENV}")
        return mapped[0]
    for path in _candidates(platform):
        if os.path.exists(path) or not os.path.dirname(path):  # a bare name: the loader searches for it
            return path
    raise LaunchError(_not_found(platform))


def _not_found(platform: str) -> str:
    if platform == _WINDOWS:
        return ("no HIP runtime (amdhip64*.dll) found: not loaded by torch, none in torch's lib\\, "
                "%HIP_PATH%\\bin or on PATH. Install the HIP SDK or a ROCm build of PyTorch for Windows, "
                f"or set {LIBRARY_ENV} to the amdhip64 DLL ROCm torch uses")
    return ("no HIP runtime (libamdhip64) found: not mapped by torch, none in torch's lib/, "
            f"{os.environ.get('ROCM_PATH', '/opt/rocm')}/lib or the system library path. Install ROCm PyTorch "
            "(pip install torch --index-url https://download.pytorch.org/whl/rocm6.2) or ROCm, "
            f"or set {LIBRARY_ENV} to the library ROCm torch uses")


DRIVER = ModuleDriver(API, library_path)


launch_kernel = DRIVER.launch_kernel
launch_function = DRIVER.launch_function
function = DRIVER.function
launch = DRIVER.launch
resident_workgroups = DRIVER.resident_workgroups


def device_count() -> int:
    """Devices the HIP runtime sees (a typed error, with the runtime's reason, where it sees none)."""
    lib = DRIVER.library()
    n = ctypes.c_int()
    rc = lib.hipGetDeviceCount(ctypes.byref(n))
    if rc != 0:
        raise UnsupportedError(f"the HIP runtime ({library_path()}) reports no usable GPU: "
                               f"{DRIVER.error_text(rc)} (error {rc}). Check that the amdgpu driver is loaded "
                               "and that this user may open /dev/kfd and /dev/dri")
    return n.value
