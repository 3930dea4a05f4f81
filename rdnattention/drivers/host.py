"""The host driver: runs kernels in the CPU emulator library built for target `host`."""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from pathlib import Path

import torch

from ..errors import IncompatibleKernelsError, InvalidArgumentError, LaunchError

PLATFORM = "host"
TARGET_ENV = "RDNATTENTION_HOST_TARGET"

_SHUFFLE_ENV = "RDNATTENTION_HOST_SHUFFLE"
_shuffle_seed: int | None = None  # None: not read from the environment yet


def set_shuffle(seed: int | None) -> None:
    """Shuffle the emulator's fiber order at every sync point (0 or None: in order).

    With a seed, a missing barrier in a kernel changes its results; same seed, same order."""
    global _shuffle_seed
    if seed is not None and (not isinstance(seed, int) or seed < 0):
        raise InvalidArgumentError(f"shuffle seed must be a non-negative int or None, got {seed!r}")
    _shuffle_seed = seed or 0


def shuffle_seed() -> int:
    global _shuffle_seed
    if _shuffle_seed is None:
        text = os.environ.get(_SHUFFLE_ENV, "0") or "0"
        try:
            seed = int(text)
        except ValueError:
            seed = -1
        if seed < 0:
            raise InvalidArgumentError(f"{_SHUFFLE_ENV}={text!r} must be a non-negative integer seed (0: in order)")
        _shuffle_seed = seed
    return _shuffle_seed


ABI_VERSION = 2  # rdna_host.h's RDNA_HOST_ABI_VERSION: the C interface this driver calls
_SYMBOLS = ("rdna_host_abi_version", "rdna_host_launch")
_ERROR_BYTES = 1024


@functools.lru_cache(maxsize=None)
def _library(path: Path) -> ctypes.CDLL:
    """The emulator library at ``path`` with its C interface bound; IncompatibleKernelsError when
    it cannot be loaded or is not an emulator library of this driver's interface version."""
    rebuild = f"rebuild with: rdnattention-gen build --targets {path.parent.name}"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise IncompatibleKernelsError(f"{path}: not a loadable host kernel library ({e}); {rebuild}") from None
    missing = [s for s in _SYMBOLS if not hasattr(lib, s)]
    if missing:
        raise IncompatibleKernelsError(f"{path} lacks {', '.join(missing)}: not an rdnattention host kernel "
                                       f"library of this version; {rebuild}")
    lib.rdna_host_abi_version.restype = ctypes.c_int
    version = lib.rdna_host_abi_version()
    if version != ABI_VERSION:
        raise IncompatibleKernelsError(f"{path}: host library interface version {version}, this runtime calls "
                                       f"version {ABI_VERSION}; {rebuild}")
    lib.rdna_host_launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint), ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_size_t, ctypes.c_ulonglong,
                                     ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_size_t]
    lib.rdna_host_launch.restype = ctypes.c_int
    return lib


def serves(device: torch.device) -> bool:
    return device.type == "cpu"


def target(device: torch.device) -> str:
    return os.environ.get(TARGET_ENV, "").strip() or "host"


def launch_kernel(code_object: Path, name: str, grid: tuple[int, int, int], threads: int, args: ctypes.Structure,
                  device: torch.device, shared_bytes: int = 0) -> None:
    """Runs kernel ``name`` of the emulator library over ``grid``; returns when it is done."""
    lib = _library(code_object)
    call = (name.encode(), (ctypes.c_uint * 3)(*grid), threads, ctypes.byref(args), ctypes.sizeof(args),
            shuffle_seed())
    if threading.current_thread() is not threading.main_thread():
        rc, error = _run(lib, call, None)
    else:
        rc, error = _run_interruptible(lib, call)
    if rc != 0:
        raise LaunchError(f"host launch failed: {error}")  # the library names the kernel


# Workgroups per worker thread that plans sized by occupancy (split-KV decode slices) count on:
# the emulator runs one workgroup per worker at a time, but a GPU-like count keeps the same
# slicing (and the merge of the slices) in play as on a GPU.
RESIDENT_WORKGROUPS = 4


def resident_workgroups(code_object: Path, name: str, threads: int, shared_bytes: int, device: torch.device) -> int:
    return RESIDENT_WORKGROUPS


def _run(lib: ctypes.CDLL, call: tuple, cancel: ctypes.c_int | None) -> tuple[int, str]:
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    rc = lib.rdna_host_launch(*call, None if cancel is None else ctypes.byref(cancel), error, _ERROR_BYTES)
    return rc, error.value.decode(errors="replace") if rc else ""


def _run_interruptible(lib: ctypes.CDLL, call: tuple) -> tuple[int, str]:
    """Runs the launch on a helper thread while the main thread waits, so that Ctrl-C (which
    Python delivers to the main thread) cancels it at the workgroups' next sync point and
    raises KeyboardInterrupt once the library has returned."""
    cancel = ctypes.c_int(0)
    result: list[tuple[int, str]] = []
    worker = threading.Thread(target=lambda: result.append(_run(lib, call, cancel)), name="rdnattention-host",
                              daemon=True)
    try:
        worker.start()
    except RuntimeError:  # no thread to spare (a memory or thread limit): run here, not interruptible
        return _run(lib, call, None)
    try:
        worker.join()
    except BaseException:
        cancel.value = 1
        worker.join()
        raise
    if not result:
        raise LaunchError("the host launch thread ended without a result")
    return result[0]


def launch(code_object: Path, launch, device: torch.device) -> None:
    """Runs one planned launch (rdnattention.plan.Launch) in the emulator library."""
    launch_kernel(code_object, launch.kernel.name, launch.grid, launch.block, launch.args, device)
