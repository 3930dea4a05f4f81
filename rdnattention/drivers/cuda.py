"""The CUDA driver: cubins loaded through ctypes on libcuda into torch's context, launched on
torch's current stream. No second context, no copies."""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch

from ..errors import LaunchError

PLATFORM = "cuda"
_lock = threading.Lock()


def serves(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None


def target(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def _libcuda() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise LaunchError(f"cannot load the CUDA driver library libcuda.so.1: {e}") from None
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
        ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(rc, ctypes.byref(msg))
        raise LaunchError(f"{what} failed: CUDA error {rc} ({(msg.value or b'unknown').decode()})")


@functools.lru_cache(maxsize=None)
def _module(path: Path, device: int) -> ctypes.c_void_p:
    # torch makes its primary context current on this device; the module is loaded into it.
    with torch.cuda.device(device):
        torch.cuda.init()
        torch.cuda.current_stream().synchronize()
        image = path.read_bytes()
        module = ctypes.c_void_p()
        _check(_libcuda().cuModuleLoadData(ctypes.byref(module), image), f"loading {path}")
    return module


_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CUfunction_attribute


@functools.lru_cache(maxsize=None)
def _function(path: Path, device: int, name: str, shared_bytes: int) -> ctypes.c_void_p:
    fn = ctypes.c_void_p()
    _check(_libcuda().cuModuleGetFunction(ctypes.byref(fn), _module(path, device), name.encode()),
           f"looking up {name} in {path}")
    if shared_bytes > 48 * 1024:  # above 48 KiB a kernel must opt in to its dynamic shared memory
        _check(_libcuda().cuFuncSetAttribute(fn, _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
               f"allowing {name} {shared_bytes} bytes of shared memory")
    return fn


def launch_kernel(code_object: Path, name: str, grid: tuple[int, int, int], threads: int, args: ctypes.Structure,
                  device: torch.device, shared_bytes: int = 0) -> None:
    """Launches kernel ``name`` of a cubin on torch's current stream of ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        fn = _function(code_object, index, name, shared_bytes)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))
    with torch.cuda.device(index):
        stream = torch.cuda.current_stream().cuda_stream
        _check(_libcuda().cuLaunchKernel(fn, *grid, threads, 1, 1, shared_bytes, ctypes.c_void_p(stream), params, None),
               f"launching {name}")


def launch(code_object: Path, launch, device: torch.device) -> None:
    """Runs one planned launch (rdnattention.plan.Launch)."""
    launch_kernel(code_object, launch.kernel.name, launch.grid, launch.block, launch.args, device, launch.shared_bytes)
