"""The host driver: runs kernels in the CPU emulator library built for target `host`."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from ..errors import InvalidArgumentError, LaunchError

PLATFORM = "host"

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


@functools.lru_cache(maxsize=None)
def _library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.rdna_host_launch.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint), ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_size_t, ctypes.c_ulonglong]
    lib.rdna_host_launch.restype = ctypes.c_int
    lib.rdna_host_last_error.restype = ctypes.c_char_p
    return lib


def serves(device: torch.device) -> bool:
    return device.type == "cpu"


def target(device: torch.device) -> str:
    return os.environ.get("RDNATTENTION_HOST_TARGET", "host")


def launch_kernel(code_object: Path, name: str, grid: tuple[int, int, int], threads: int, args: ctypes.Structure,
                  device: torch.device, shared_bytes: int = 0) -> None:
    """Runs kernel ``name`` of the emulator library over ``grid``; returns when it is done."""
    lib = _library(code_object)
    rc = lib.rdna_host_launch(name.encode(), (ctypes.c_uint * 3)(*grid), threads, ctypes.byref(args),
                              ctypes.sizeof(args), shuffle_seed())
    if rc != 0:
        raise LaunchError(f"host launch of {name} failed: {lib.rdna_host_last_error().decode()}")


def launch(code_object: Path, launch, device: torch.device) -> None:
    """Runs one planned launch (rdnattention.plan.Launch) in the emulator library."""
    launch_kernel(code_object, launch.kernel.name, launch.grid, launch.block, launch.args, device)
