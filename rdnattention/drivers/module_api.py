"""The module-launch API that the CUDA driver API and HIP's module API share: load a code object
from bytes, look a kernel up by name, allow it large dynamic shared memory, say how many of its
workgroups a compute unit holds at once, launch it with its argument struct on torch's current
stream, and say what an error code means. One implementation
serves both vendors; each driver gives the symbol names and how to find its library."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import LaunchError

# torch's raw current-stream handle and current device, without building Python objects per call
# (torch.cuda.current_stream() constructs a Stream each time); the public calls where absent.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def current_stream_handle(index: int) -> int:
    return _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).cuda_stream


def current_device() -> int:
    return _get_device() if _get_device is not None else torch.cuda.current_device()


@dataclass(frozen=True)
class ModuleApi:
    vendor: str                 # "CUDA", "HIP": for messages
    load: str                   # (module*, const void* image) -> status
    get_function: str           # (function*, module, const char* name) -> status
    launch: str                 # (function, grid xyz, block xyz, shared bytes, stream, void** params, void** extra)
    error_string: str
    error_string_returns: bool  # True: const char* f(status); False: status f(status, const char**)
    # (int* workgroups, function, int threads, size_t dynamic shared bytes) -> status: the
    # workgroups of a kernel one compute unit holds at once (registers, LDS, wave slots)
    occupancy: str
    set_attribute: str | None   # (function, attribute, value) -> status; None: no dynamic shared memory
    max_dynamic_shared: int     # the attribute that lets a kernel use more than 48 KiB of dynamic LDS

    @property
    def symbols(self) -> tuple[str, ...]:
        return tuple(s for s in (self.load, self.get_function, self.launch, self.error_string, self.occupancy,
                                 self.set_attribute) if s)


_P = ctypes.POINTER
_ONE_PARAM = ctypes.c_void_p * 1  # kernels take one argument: their struct


class ModuleDriver:
    """Loads code objects per device into the context torch uses, and launches their kernels."""

    def __init__(self, api: ModuleApi, library: Callable[[], str]):
        self.api, self._library_path = api, library
        self._lib: ctypes.CDLL | None = None
        self._lock = threading.Lock()
        self._modules: dict[tuple[Path, int], ctypes.c_void_p] = {}
        # Each module's code-object image, by the same key, for as long as the module: ROCr keeps a
        # pointer into the image it loaded (debuggers and profilers read it later through its
        # memory:// URI), so the memory handed to the load call must outlive the module.
        self._images: dict[tuple[Path, int], ctypes.Array] = {}
        self._functions: dict[tuple[Path, int, str, int], ctypes.c_void_p] = {}
        self._resident: dict[tuple[Path, int, str, int, int], int] = {}
        self._raw_launch = None  # (library, its launch entry point without argument types): bound's
        # bound's launches, by kernel handle, grid, threads and shared bytes (handles stay valid for
        # as long as their modules, which are never unloaded)
        self._bound: dict[tuple, Callable] = {}

    def library(self) -> ctypes.CDLL:
        """The runtime library with every symbol the driver uses bound; LaunchError names a missing one."""
        if self._lib is None:
            path = self._library_path()
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                raise LaunchError(f"cannot load the {self.api.vendor} library {path}: {e}") from None
            missing = [s for s in self.api.symbols if not hasattr(lib, s)]
            if missing:
                raise LaunchError(f"{path} lacks {', '.join(missing)}: not a {self.api.vendor} runtime this "
                                  "driver can use")
            a = self.api
            getattr(lib, a.load).argtypes = [_P(ctypes.c_void_p), ctypes.c_void_p]
            getattr(lib, a.get_function).argtypes = [_P(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
            getattr(lib, a.launch).argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
                ctypes.c_void_p, _P(ctypes.c_void_p), _P(ctypes.c_void_p)]
            if a.error_string_returns:
                getattr(lib, a.error_string).argtypes = [ctypes.c_int]
                getattr(lib, a.error_string).restype = ctypes.c_char_p
            else:
                getattr(lib, a.error_string).argtypes = [ctypes.c_int, _P(ctypes.c_char_p)]
            getattr(lib, a.occupancy).argtypes = [_P(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
            if a.set_attribute:
                getattr(lib, a.set_attribute).argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            self._lib = lib
        return self._lib

    def error_text(self, rc: int) -> str:
        fn = getattr(self.library(), self.api.error_string)
        if self.api.error_string_returns:
            text = fn(rc)
        else:
            out = ctypes.c_char_p()
            fn(rc, ctypes.byref(out))
            text = out.value
        return (text or b"unknown").decode(errors="replace")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise LaunchError(f"{what} failed: {self.api.vendor} error {rc} ({self.error_text(rc)})")

    def _module(self, path: Path, device: int) -> ctypes.c_void_p:
        key = (path, device)
        if key not in self._modules:
            data = path.read_bytes()
            image = (ctypes.c_char * len(data)).from_buffer_copy(data)
            # torch's context on this device is made current; the module is loaded into it.
            with torch.cuda.device(device):
                torch.cuda.init()
                # The device's primary context made, if nothing has made it yet (torch makes it at its
                # first allocation or launch; loading into none fails): a query of the stream, which
                # waits for nothing. (Not where torch has no GPU: the emulator's stand-in.)
                if torch.cuda.is_available():
                    torch.cuda.current_stream(device).query()
                module = ctypes.c_void_p()
                self.check(getattr(self.library(), self.api.load)(ctypes.byref(module),
                                                                  ctypes.c_void_p(ctypes.addressof(image))),
                           f"loading {path}")
            self._images[key] = image
            self._modules[key] = module
        return self._modules[key]

    def function(self, path: Path, device: int, name: str, shared_bytes: int) -> ctypes.c_void_p:
        key = (path, device, name, shared_bytes)
        fn = self._functions.get(key)
        if fn is None:
            with self._lock:
                fn = ctypes.c_void_p()
                self.check(getattr(self.library(), self.api.get_function)(ctypes.byref(fn), self._module(path, device),
                                                                          name.encode()),
                           f"looking up {name} in {path}")
                if shared_bytes > 48 * 1024 and self.api.set_attribute:
                    self.check(getattr(self.library(), self.api.set_attribute)(fn, self.api.max_dynamic_shared,
                                                                               shared_bytes),
                               f"allowing {name} {shared_bytes} bytes of shared memory")
                self._functions[key] = fn
        return fn

    def resident_workgroups(self, code_object: Path, name: str, threads: int, shared_bytes: int,
                            device: torch.device) -> int:
        """Workgroups of ``threads`` threads of kernel ``name`` that one compute unit of ``device``
        holds at once, as the runtime computes it from the kernel's registers and LDS (at least 1)."""
        index = current_device() if device.index is None else device.index
        key = (code_object, index, name, threads, shared_bytes)
        if key not in self._resident:
            fn = self.function(code_object, index, name, shared_bytes)
            count = ctypes.c_int()
            with torch.cuda.device(index):
                self.check(getattr(self.library(), self.api.occupancy)(ctypes.byref(count), fn, threads, shared_bytes),
                           f"asking the occupancy of {name}")
            self._resident[key] = max(1, count.value)
        return self._resident[key]

    def launch(self, code_object: Path, launch, device: torch.device) -> None:
        """Runs one planned launch (rdnattention.plan.Launch)."""
        self.launch_kernel(code_object, launch.kernel.name, launch.grid, launch.block, launch.args, device,
                           launch.shared_bytes)

    def launch_kernel(self, code_object: Path, name: str, grid: tuple[int, int, int], threads: int,
                      args: ctypes.Structure, device: torch.device, shared_bytes: int = 0) -> None:
        """Launches kernel ``name`` on torch's current stream of ``device``, without synchronising."""
        index = current_device() if device.index is None else device.index
        self.launch_function(self.function(code_object, index, name, shared_bytes), name, index, grid, threads, args,
                             shared_bytes)

    def launch_function(self, fn: ctypes.c_void_p, name: str, index: int, grid: tuple[int, int, int], threads: int,
                        args: ctypes.Structure, shared_bytes: int = 0) -> None:
        """Launches the kernel handle ``fn`` (``function``; ``name`` for messages) on torch's current
        stream of device ``index``, without synchronising."""
        go = self.bound(fn, name, grid, threads, shared_bytes)
        if index == current_device():
            go(args, current_stream_handle(index))
        else:  # the launch goes to the context of the tensors' device
            with torch.cuda.device(index):
                go(args, current_stream_handle(index))

    def bound(self, fn: ctypes.c_void_p, name: str, grid: tuple[int, int, int], threads: int,
              shared_bytes: int = 0) -> Callable[[ctypes.Structure, int], None]:
        """The launch of kernel handle ``fn`` over ``grid`` with its block and shared bytes converted
        to the entry point's C types once: called with an argument struct and a stream handle of the
        current device (the replays' launches: launch_function's work less what is fixed per step)."""
        lib = self.library()
        if self._raw_launch is None or self._raw_launch[0] is not lib:  # (a library replaced: none bound to it)
            # A function pointer of its own, without argument types: every argument it is given is of
            # its C type already (ctypes' conversion of eleven arguments by argtypes is most of a
            # launch's Python cost); a stand-in runtime's entry points (tests) are prototyped pointers.
            entry = lib[self.api.launch] if isinstance(lib, ctypes.CDLL) else getattr(lib, self.api.launch)
            entry.restype = ctypes.c_int
            self._raw_launch = (lib, entry)
            self._bound = {}
        handle = fn.value if isinstance(fn, ctypes.c_void_p) else fn
        key = (handle, tuple(grid), threads, shared_bytes)
        go = self._bound.get(key)
        if go is not None:
            return go
        entry = self._raw_launch[1]
        fixed = (ctypes.c_void_p(handle), *(ctypes.c_uint(n) for n in (*grid, threads, 1, 1, shared_bytes)))
        check, addressof, pointer = self.check, ctypes.addressof, ctypes.c_void_p

        def go(args: ctypes.Structure, stream: int) -> None:
            rc = entry(*fixed, pointer(stream), _ONE_PARAM(addressof(args)), None)
            if rc:
                check(rc, f"launching {name}")
        if len(self._bound) >= 4096:  # grids of many shapes: start again rather than grow without bound
            self._bound.clear()
        self._bound[key] = go
        return go
