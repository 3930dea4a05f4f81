"""The HIP driver (platform amdgcn): HSA code objects loaded through ctypes on the libamdhip64 that
ROCm torch already has in the process (the same runtime and context: a second copy of the library
fails at launch), launched on torch's current stream.

Target resolution: RDNATTENTION_TARGET if set, else HSA_OVERRIDE_GFX_VERSION as ROCm reads it
(10.3.0 -> gfx1030), else the device's gcnArchName without its feature suffix
(gfx1030:sramecc-:xnack- -> gfx1030)."""

from __future__ import annotations

import ctypes.util
import functools
import glob
import os
import re
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


def mapped_libraries() -> list[str]:
    """Every libamdhip64 mapped into this process (torch's, once ROCm torch is initialised)."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                if "/libamdhip64.so" in path and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def library_path() -> str:
    """The libamdhip64 to bind: the copy already mapped (ROCm torch's), else the one torch ships,
    else ROCm's, else the system's, else $RDNATTENTION_HIP_LIBRARY. Never a second copy."""
    mapped = mapped_libraries()
    explicit = os.environ.get(LIBRARY_ENV)
    if len(mapped) > 1:
        raise LaunchError(f"two HIP runtimes are mapped into this process ({', '.join(mapped)}); kernels launched "
                          "through one would not see the other's memory. Load only ROCm torch's")
    if mapped:
        if explicit and os.path.realpath(explicit) != os.path.realpath(mapped[0]):
            raise LaunchError(f"{LIBRARY_ENV}={explicit} is not the HIP runtime this process already uses "
                              f"({mapped[0]}); a second copy fails at launch. Unset {LIBRARY_ENV}")
        return mapped[0]
    candidates = sorted(glob.glob(str(Path(torch.__file__).parent / "lib" / "libamdhip64.so*")))
    rocm = os.environ.get("ROCM_PATH", "/opt/rocm")
    candidates += sorted(glob.glob(os.path.join(rocm, "lib", "libamdhip64.so*")))
    system = ctypes.util.find_library("amdhip64")
    candidates += [system] if system else []
    candidates += [explicit] if explicit else []
    for path in candidates:
        if os.path.exists(path) or "/" not in path:
            return path
    raise LaunchError(
        "no HIP runtime (libamdhip64) found: not mapped by torch, none in torch's lib/, "
        f"{rocm}/lib or the system library path. Install ROCm PyTorch "
        "(pip install torch --index-url https://download.pytorch.org/whl/rocm6.2) or ROCm, "
        f"or set {LIBRARY_ENV} to the library ROCm torch uses")


DRIVER = ModuleDriver(API, library_path)


launch_kernel = DRIVER.launch_kernel
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
