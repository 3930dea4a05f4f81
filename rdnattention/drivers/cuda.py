"""The CUDA driver: cubins loaded through ctypes on libcuda into torch's primary context, launched
on torch's current stream. No second context, no copies."""

from __future__ import annotations

import functools

import torch

from .module_api import ModuleApi, ModuleDriver, current_device

PLATFORM = "cuda"
API = ModuleApi(vendor="CUDA", load="cuModuleLoadData", get_function="cuModuleGetFunction",
                launch="cuLaunchKernel", error_string="cuGetErrorString", error_string_returns=False,
                occupancy="cuOccupancyMaxActiveBlocksPerMultiprocessor",
                set_attribute="cuFuncSetAttribute", max_dynamic_shared=8)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def serves(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None


@functools.lru_cache(maxsize=None)
def _target(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def target(device: torch.device) -> str:
    return _target(device.index if device.index is not None else current_device())


def library_path() -> str:
    return "libcuda.so.1"


DRIVER = ModuleDriver(API, library_path)


launch_kernel = DRIVER.launch_kernel
launch_function = DRIVER.launch_function
function = DRIVER.function
launch = DRIVER.launch
resident_workgroups = DRIVER.resident_workgroups
