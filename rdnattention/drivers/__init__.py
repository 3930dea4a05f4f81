"""Drivers, one per platform: which devices a driver serves, which target a device is, and how a
planned launch runs there. Each module defines PLATFORM, serves(device), target(device) and
launch(code_object, launch, device)."""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from ..errors import UnsupportedError
from . import cuda, hip, host

DRIVERS: dict[str, ModuleType] = {d.PLATFORM: d for d in (host, cuda, hip)}
TARGET_ENV = "RDNATTENTION_TARGET"


def for_platform(platform: str) -> ModuleType:
    try:
        return DRIVERS[platform]
    except KeyError:
        raise UnsupportedError(f"no driver for platform {platform!r}; drivers: {', '.join(sorted(DRIVERS))}") from None


_served: dict[tuple, ModuleType] = {}  # (device type, torch's HIP version) -> the driver serving it


def for_device(device: torch.device) -> ModuleType:
    key = (device.type, torch.version.hip)
    driver = _served.get(key)
    if driver is not None:
        return driver
    for driver in DRIVERS.values():
        if driver.serves(device):
            _served[key] = driver
            return driver
    raise UnsupportedError(f"tensors on {device} are not served: rdnattention runs CPU tensors on the host "
                           "emulator and GPU tensors of ROCm (AMD) and CUDA (NVIDIA) builds of torch")


@functools.lru_cache(maxsize=None)
def _encoded(name: str):
    return os.environ.encodekey(name)


def env_token(name: str) -> object:
    """Environment variable ``name`` as os.environ holds it (bytes on POSIX; None where unset), for
    cache keys: os.environ.get costs a microsecond where the variable is unset."""
    data = getattr(os.environ, "_data", None)
    if data is None or not hasattr(os.environ, "encodekey"):
        return os.environ.get(name)
    return data.get(_encoded(name))


_TARGET_VARIABLES = (TARGET_ENV, host.TARGET_ENV, "HSA_OVERRIDE_GFX_VERSION")


def environment_token() -> tuple:
    """Every environment variable that decides a device's target (target_of, whichever driver serves
    it), as os.environ holds them, for cache keys: the drivers are fixed per device type for the
    process, so this and the device decide the target. One read each, without function calls per
    variable (route.device_table takes it on every call)."""
    data = getattr(os.environ, "_data", None)
    if data is None or not hasattr(os.environ, "encodekey"):
        return tuple(os.environ.get(name) for name in _TARGET_VARIABLES)
    a, b, c = _ENCODED_TARGET_VARIABLES or _encode_target_variables()
    return data.get(a), data.get(b), data.get(c)


_ENCODED_TARGET_VARIABLES: tuple = ()


def _encode_target_variables() -> tuple:
    global _ENCODED_TARGET_VARIABLES
    _ENCODED_TARGET_VARIABLES = tuple(_encoded(name) for name in _TARGET_VARIABLES)
    return _ENCODED_TARGET_VARIABLES


def target_token(device: torch.device) -> tuple:
    """What decides ``device``'s target (target_of), for cache keys: its driver and the
    environment variables that driver reads."""
    driver = for_device(device)
    if driver is host:
        return driver, env_token(host.TARGET_ENV)
    return driver, env_token(TARGET_ENV), env_token("HSA_OVERRIDE_GFX_VERSION")


_PLATFORM_OF_PREFIX = (("host", host.PLATFORM), ("sm_", cuda.PLATFORM), ("gfx", hip.PLATFORM))


def platform_named(target: str) -> str | None:
    """The platform a target's name says it belongs to (host*, sm_*, gfx*), or None for a name of
    no known kind: its table, once built, says."""
    for prefix, platform in _PLATFORM_OF_PREFIX:
        if target.startswith(prefix):
            return platform
    return None


def env_naming_target(device: torch.device) -> str | None:
    """The environment variable that chose ``device``'s target, if one did."""
    driver = for_device(device)
    if driver is host:
        return host.TARGET_ENV if os.environ.get(host.TARGET_ENV) else None
    return TARGET_ENV if os.environ.get(TARGET_ENV) else None


def target_of(device: torch.device, driver: ModuleType | None = None) -> str:
    """The build target whose kernels run tensors on ``device``: $RDNATTENTION_TARGET for GPU
    devices where set, else what the device's driver resolves."""
    driver = driver or for_device(device)
    forced = os.environ.get(TARGET_ENV)
    if forced and driver is not host:
        return forced.strip()
    return driver.target(device)
