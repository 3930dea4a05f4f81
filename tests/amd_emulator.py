"""Runs the real AMD code objects: a stand-in for the HIP runtime whose module API executes the
launched kernel's machine code on tinygrad's RDNA3 ISA emulator (a pinned source snapshot; see
../shared/third_party/README.md), so calls go through the project's own planner and HIP driver
unchanged, and only what lies below ``hipModuleLaunchKernel`` is replaced.

What the stand-in does as HIP and the ROCm loader do: it finds the image's size from its ELF
headers (``hipModuleLoadData`` gets a bare pointer), maps the loadable segments, resolves kernels
by their descriptor symbol, refuses launches whose block exceeds the kernel's
``.max_flat_workgroup_size`` or whose grid exceeds 2^32 - 1 work-items, copies each argument of the
metadata's ``.args`` from ``kernelParams[i]`` into a kernarg segment of ``.kernarg_segment_size``,
and dispatches with the descriptor's user SGPRs (the kernarg pointer), workgroup ids and an LDS
allocation of the static size plus the dynamic bytes. Memory is the process's: CPU tensors'
addresses are the kernels' global addresses.

What differs from the silicon: the emulator executes one workgroup after another and one wave at
a time between barriers (no concurrency between workgroups), models no caches, and flushes fp32
denormals. It does not decode ``buffer_gl0_inv`` and ``buffer_gl1_inv`` (the cache invalidates of
acquire fences: a workgroup's, and the device-wide one the split-KV slices' merge takes), so the
mapped copy has them replaced by two ``s_nop 0`` each; the built file is never changed. RDNA3 (gfx11,
wave32) only: gfx10 and GCN encodings are not executed here.

RDNATTENTION_TINYGRAD names the snapshot; by default ``<checkout>/../shared/third_party/tinygrad``."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rdnattention_gen.hsaco import CodeObject

SNAPSHOT_ENV = "RDNATTENTION_TINYGRAD"
_REPO = Path(__file__).resolve().parent.parent
DEFAULT_SNAPSHOT = _REPO.parent / "shared" / "third_party" / "tinygrad"
EMULATOR = Path("test") / "mockgpu" / "amd" / "emu.py"

# HIP error codes the stand-in returns (hip_runtime_api.h).
HIP_SUCCESS = 0
HIP_ERROR_INVALID_VALUE = 1
HIP_ERROR_INVALID_IMAGE = 200
HIP_ERROR_NOT_FOUND = 500
HIP_ERROR_INVALID_HANDLE = 400
HIP_ERROR_LAUNCH_FAILURE = 719
_ERROR_NAMES = {HIP_SUCCESS: "hipSuccess", HIP_ERROR_INVALID_VALUE: "hipErrorInvalidValue",
                HIP_ERROR_INVALID_IMAGE: "hipErrorInvalidImage", HIP_ERROR_NOT_FOUND: "hipErrorNotFound",
                HIP_ERROR_INVALID_HANDLE: "hipErrorInvalidHandle", HIP_ERROR_LAUNCH_FAILURE: "hipErrorLaunchFailure"}

_GRID_WORK_ITEMS_MAX = 2**32 - 1    # HSA's AQL packet counts the grid in work-items, as uint32
_LDS_GRANULE = 512                  # compute_pgm_rsrc2.LDS_SIZE unit on gfx10+ (bytes)
_RSRC2_LDS_SHIFT, _RSRC2_LDS_MASK = 15, 0x1FF
_PAGE = 4096
_S_NOP_0 = struct.pack("<I", 0xBF800000)
_CACHE_INV = re.compile(r"^\s+buffer_gl[01]_inv\s*// ([0-9A-F]+): ((?:[0-9A-F]{8} ?)+)")
_VOID_P_P = ctypes.POINTER(ctypes.c_void_p)


def snapshot() -> Path | None:
    """The tinygrad snapshot holding the emulator, or None where this checkout has none."""
    path = Path(os.environ.get(SNAPSHOT_ENV) or DEFAULT_SNAPSHOT)
    return path if (path / EMULATOR).is_file() else None


class EmulatorError(RuntimeError):
    """The stand-in met something it does not emulate or the kernel broke a rule HIP enforces."""


@dataclass
class Kernel:
    name: str
    metadata: dict
    descriptor: object      # hsaco.KernelDescriptor
    entry: int              # address of the first instruction in the mapped copy


@dataclass
class Module:
    code_object: CodeObject
    mapped: ctypes.Array                 # the loaded segments (the emulator fetches instructions here)
    base: int
    image_pointer: int                   # what hipModuleLoadData was given, and the bytes it held
    image_sha256: str
    neutralised: int                     # buffer_gl0_inv and buffer_gl1_inv instructions replaced in the mapped copy
    kernels: dict[str, Kernel] = field(default_factory=dict)


@dataclass(frozen=True)
class Dispatch:
    """One launch as the emulator ran it."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    lds_bytes: int
    kernarg: bytes


def _elf_size(pointer: int) -> int:
    """The image's size from its headers, as a loader given only a pointer finds it: the end of
    the section header table or of the last section, whichever is further."""
    header = ctypes.string_at(pointer, 64)
    if header[:4] != b"\x7fELF" or header[4] != 2:
        raise EmulatorError("hipModuleLoadData: the image is not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", header, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", header, 0x3A)
    end = shoff + shentsize * shnum
    for i in range(shnum):
        entry = ctypes.string_at(pointer + shoff + i * shentsize, shentsize)
        kind, = struct.unpack_from("<I", entry, 4)
        offset, size = struct.unpack_from("<QQ", entry, 0x18)
        if kind != 8:  # SHT_NOBITS occupies no file bytes
            end = max(end, offset + size)
    return end


class EmulatedHip:
    """The five HIP module-API entry points the driver binds, as ctypes function pointers whose
    bodies are the stand-in. Every dispatch is recorded in ``dispatches``."""

    def __init__(self, emu, objdump: str, target_model=None):
        self._emu, self._objdump, self._target = emu, objdump, target_model
        self.modules: dict[int, Module] = {}
        self.functions: dict[int, Kernel] = {}
        self.dispatches: list[Dispatch] = []
        self.failures: list[BaseException] = []   # exceptions the callbacks turned into error codes
        self._handles = 0x1000
        self._strings: dict[int, ctypes.Array] = {}
        c = ctypes
        self.hipModuleLoadData = self._entry(c.c_int, [_VOID_P_P, c.c_void_p], self._load)
        self.hipModuleGetFunction = self._entry(c.c_int, [_VOID_P_P, c.c_void_p, c.c_char_p], self._get_function)
        self.hipModuleLaunchKernel = self._entry(
            c.c_int, [c.c_void_p] + [c.c_uint] * 7 + [c.c_void_p, _VOID_P_P, _VOID_P_P], self._launch)
        # const char* hipGetErrorString(hipError_t), as the driver binds it (restype c_char_p): the
        # callback returns its string's address, and the bound function reads the string there.
        self._error_string_callback = c.CFUNCTYPE(c.c_void_p, c.c_int)(self._error_string)
        self.hipGetErrorString = c.cast(self._error_string_callback, c.CFUNCTYPE(c.c_char_p, c.c_int))
        self.hipModuleOccupancyMaxActiveBlocksPerMultiprocessor = self._entry(
            c.c_int, [c.POINTER(c.c_int), c.c_void_p, c.c_int, c.c_size_t], self._occupancy)

    def _entry(self, restype, argtypes, body):
        def call(*args):
            try:
                return body(*args)
            except BaseException as e:  # an exception must not cross the C boundary: report it as HIP would
                self.failures.append(e)
                return HIP_ERROR_LAUNCH_FAILURE
        return ctypes.CFUNCTYPE(restype, *argtypes)(call)

    def _error_string(self, rc: int) -> int:
        text = _ERROR_NAMES.get(rc, "hipErrorUnknown")
        if rc == HIP_ERROR_LAUNCH_FAILURE and self.failures:
            last = self.failures[-1]
            text += f" (stand-in: {type(last).__name__}: {last})"
        buf = self._strings.setdefault(rc, ctypes.create_string_buffer(4096))
        buf.value = text.encode()[:4095]
        return ctypes.addressof(buf)

    def _handle(self) -> int:
        self._handles += 0x10
        return self._handles

    # hipModuleLoadData(hipModule_t* module, const void* image)
    def _load(self, module_out, image: int) -> int:
        size = _elf_size(image)
        data = ctypes.string_at(image, size)
        try:
            co = CodeObject(data, f"image at 0x{image:x}")
        except ValueError:
            return HIP_ERROR_INVALID_IMAGE
        if co.metadata.get("amdhsa.target", "").split("--")[-1].split(":")[0] != "gfx1100":
            raise EmulatorError(f"the emulator executes gfx1100 (RDNA3) code; this image is for "
                                f"{co.metadata.get('amdhsa.target')}")
        span = max(s.vaddr + s.mem_size for s in co.segments)
        mapped = ctypes.create_string_buffer(span + _PAGE)
        base = -(-ctypes.addressof(mapped) // _PAGE) * _PAGE
        for s in co.segments:
            ctypes.memmove(base + s.vaddr, s.data, len(s.data))
        neutralised = self._neutralise_cache_invalidates(data, base)
        module = Module(co, mapped, base, image, hashlib.sha256(data).hexdigest(), neutralised)
        handle = self._handle()
        self.modules[handle] = module
        module_out[0] = handle
        return HIP_SUCCESS

    def _neutralise_cache_invalidates(self, image: bytes, base: int) -> int:
        """Replaces every buffer_gl0_inv and buffer_gl1_inv of the mapped copy by s_nop 0 words of the
        same length (the emulator has no caches to invalidate, and no decoder for the instructions)."""
        with _temporary_file(image) as path:
            listing = subprocess.run([self._objdump, "-d", str(path)], capture_output=True, text=True,
                                     check=True).stdout
        count = 0
        for line in listing.splitlines():
            m = _CACHE_INV.match(line)
            if m:
                words = len(m[2].split())
                ctypes.memmove(base + int(m[1], 16), _S_NOP_0 * words, 4 * words)
                count += 1
        return count

    # hipModuleGetFunction(hipFunction_t* function, hipModule_t module, const char* name)
    def _get_function(self, function_out, module: int, name: bytes) -> int:
        mod = self.modules.get(module)
        if mod is None:
            return HIP_ERROR_INVALID_HANDLE
        name = name.decode()
        if name not in mod.code_object.kernels:
            return HIP_ERROR_NOT_FOUND
        kernel = mod.kernels.get(name)
        if kernel is None:
            descriptor = mod.code_object.descriptor(name)
            address = mod.code_object.descriptor_address(name)
            kernel = mod.kernels[name] = Kernel(name, mod.code_object.kernels[name], descriptor,
                                                mod.base + address + descriptor.entry_offset)
        handle = self._handle()
        self.functions[handle] = kernel
        function_out[0] = handle
        return HIP_SUCCESS

    # hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, hipFunction_t f, int threads, size_t lds)
    def _occupancy(self, blocks_out, function: int, threads: int, dynamic_lds: int) -> int:
        kernel = self.functions.get(function)
        if kernel is None:
            return HIP_ERROR_INVALID_HANDLE
        lds = kernel.metadata[".group_segment_fixed_size"] + dynamic_lds
        waves = self._target.waves_per_simd(kernel.metadata[".vgpr_count"], lds, threads)
        blocks_out[0] = max(1, waves * self._target.simds_per_cu // -(-threads // self._target.wave_size))
        return HIP_SUCCESS

    # hipModuleLaunchKernel(f, gridX, gridY, gridZ, blockX, blockY, blockZ, sharedMemBytes, stream,
    #                       void** kernelParams, void** extra)
    def _launch(self, function: int, gx, gy, gz, bx, by, bz, dynamic_lds, stream, params, extra) -> int:
        kernel = self.functions.get(function)
        if kernel is None:
            return HIP_ERROR_INVALID_HANDLE
        md, kd = kernel.metadata, kernel.descriptor
        if bx * by * bz > md[".max_flat_workgroup_size"] or min(gx, gy, gz, bx, by, bz) < 1:
            return HIP_ERROR_INVALID_VALUE
        if any(g * b > _GRID_WORK_ITEMS_MAX for g, b in ((gx, bx), (gy, by), (gz, bz))):
            return HIP_ERROR_INVALID_VALUE
        if bool(params) == bool(extra):  # exactly one way of passing arguments
            return HIP_ERROR_INVALID_VALUE
        if extra:
            raise EmulatorError("the stand-in takes arguments through kernelParams only, as the driver passes them")
        lds = md[".group_segment_fixed_size"] + dynamic_lds
        if lds > 65536:
            return HIP_ERROR_INVALID_VALUE
        if kd.wave_size != 32:
            raise EmulatorError(f"{kernel.name} is wave{kd.wave_size}; the RDNA3 emulator runs wave32")
        kernarg = self._kernarg(kernel, params)
        user_data = []
        for what, count in kd.user_sgprs:
            if what != "kernarg_segment_ptr":
                raise EmulatorError(f"{kernel.name} enables the {what} user SGPRs, which the stand-in does not "
                                    "provide (the audit allows only the kernarg segment pointer)")
            user_data += [ctypes.addressof(kernarg) & 0xFFFFFFFF, ctypes.addressof(kernarg) >> 32]
        rsrc2 = kd.compute_pgm_rsrc2 & ~(_RSRC2_LDS_MASK << _RSRC2_LDS_SHIFT)
        rsrc2 |= -(-lds // _LDS_GRANULE) << _RSRC2_LDS_SHIFT
        self.dispatches.append(Dispatch(kernel.name, (gx, gy, gz), (bx, by, bz), lds,
                                        ctypes.string_at(ctypes.addressof(kernarg), ctypes.sizeof(kernarg))))
        self._emu.run_asm(kernel.entry, 0, gx, gy, gz, bx, by, bz, ctypes.addressof(kernarg), rsrc2=rsrc2,
                          scratch_size=kd.private_segment_fixed_size, arch="rdna3", user_data=user_data)
        return HIP_SUCCESS

    @staticmethod
    def _kernarg(kernel: Kernel, params) -> ctypes.Array:
        """The kernarg segment as HIP fills it: argument i's ``.size`` bytes copied from
        ``kernelParams[i]`` to its ``.offset``; hidden arguments are not emulated."""
        md = kernel.metadata
        align = max(16, md[".kernarg_segment_align"])
        segment = (ctypes.c_ubyte * md[".kernarg_segment_size"])()
        if ctypes.addressof(segment) % align:
            raise EmulatorError(f"kernarg segment not {align}-byte aligned")
        for i, arg in enumerate(md.get(".args", [])):
            if arg[".value_kind"].startswith("hidden_"):
                raise EmulatorError(f"{kernel.name} has the hidden argument {arg['.value_kind']}; "
                                    "the stand-in does not provide hidden arguments")
            if arg[".offset"] + arg[".size"] > len(segment):
                raise EmulatorError(f"{kernel.name}: argument {i} ends past the kernarg segment")
            ctypes.memmove(ctypes.addressof(segment) + arg[".offset"], params[i], arg[".size"])
        return segment

    def image_intact(self, module: Module) -> bool:
        """Whether the bytes hipModuleLoadData was given are still there (ROCr keeps the pointer)."""
        size = _elf_size(module.image_pointer)
        return hashlib.sha256(ctypes.string_at(module.image_pointer, size)).hexdigest() == module.image_sha256


@contextlib.contextmanager
def _temporary_file(data: bytes):
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".hsaco") as f:
        f.write(data)
        f.flush()
        yield Path(f.name)


def import_emulator(tinygrad: Path, clang: str, cache_dir: Path):
    """tinygrad's emulator module. Its instruction kernels compile with ``clang`` (tinygrad reads
    $CC once) and are cached in ``cache_dir`` (tinygrad reads $CACHEDB at import), not in ~/.cache."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in ("CC", "CACHEDB")}
    os.environ["CC"], os.environ["CACHEDB"] = clang, str(cache_dir / "tinygrad.db")
    # First on the path: the snapshot's `test` package, not the standard library's; it stays there
    # because the emulator imports tinygrad's backends as it first compiles an instruction.
    sys.path.insert(0, str(tinygrad))
    try:
        from test.mockgpu.amd import emu
        from tinygrad.helpers import getenv
        getenv("CC", "clang")  # read while $CC names our clang: tinygrad caches what it read
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _keep_instruction_programs(emu, clang, cache_dir / "programs")
    return emu


@dataclass
class _Program:
    """What the emulator reads of an instruction's program besides its runtime: its buffers' order."""

    globals: list

    @property
    def arg(self):
        return self


def _keep_instruction_programs(emu, clang: str, directory: Path) -> None:
    """The emulator makes a program for each instruction pattern it meets (its canonical
    (type, base, mask, size): one program serves every instruction that differs only in its
    operands) through tinygrad's code generator, about 0.15 s each, once per process; $CACHEDB
    keeps only the compile after it. Each program is kept in ``directory`` too, one file per
    pattern, so that the other test worker and later runs load the few hundred programs the kernels
    need instead of generating them again. Files are keyed by the emulator's sources and the
    compiler: another snapshot or clang makes its own."""
    if getattr(emu, "_programs_kept_in", None) is not None:
        return
    import functools
    import pickle
    import tempfile

    from tinygrad.device import Device

    directory.mkdir(parents=True, exist_ok=True)
    sources = [Path(emu.__file__), Path(emu.__file__).with_name("pcode.py")]
    version = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + clang.encode()).hexdigest()[:16]
    stored: dict[tuple[str, str, int], list[tuple[int, int, list, object]]] = {}
    for path in sorted(directory.glob(f"{version}-*.pickle")):
        try:
            kind, arch, base, mask, size, globals_, elf = pickle.loads(path.read_bytes())
        except Exception:  # noqa: BLE001 - a file cut short by a killed run: generated again
            continue
        stored.setdefault((kind, arch, size), []).append((base, mask, globals_, elf))
    generate = emu._get_runner.__wrapped__

    def kind_of(inst_type: type) -> str:
        return f"{inst_type.__module__}.{inst_type.__qualname__}"

    @functools.cache
    def get_runner(inst_bytes: bytes, arch: str = "rdna3"):
        inst = emu.decode_inst(inst_bytes, arch)
        size = inst.size()
        value = int.from_bytes(inst_bytes[:size], "little")
        kind = kind_of(type(inst))
        for i, (base, mask, globals_, elf) in enumerate(stored.get((kind, arch, size), ())):
            if value & mask == base:  # handed to the emulator's own table, where generate() finds it
                runner = (_Program(list(globals_)), Device["CPU"].runtime(elf))
                emu._canonical_runner_cache.append((type(inst), base, mask, size, runner))
                del stored[kind, arch, size][i]
                break
        known = len(emu._canonical_runner_cache)
        runner = generate(inst_bytes, arch)
        for inst_type, base, mask, size, (prg, _) in emu._canonical_runner_cache[known:]:
            kind = kind_of(inst_type)
            data = pickle.dumps((kind, arch, base, mask, size, list(prg.arg.globals), prg.to_elf()))
            name = hashlib.sha256(repr((kind, arch, base, mask, size)).encode()).hexdigest()[:24]
            with tempfile.NamedTemporaryFile(dir=directory, delete=False) as f:  # whole or not at all
                f.write(data)
            os.replace(f.name, directory / f"{version}-{name}.pickle")
        return runner

    emu._get_runner = get_runner
    emu._programs_kept_in = directory


class _NoContext:
    """torch.cuda.device(i) where there is no CUDA: the stand-in has one device."""

    def __init__(self, *_):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def serve_as_gpu(mp, matrix, build_dir: Path, tinygrad: Path, target: str):
    """CPU tensors served as if on a ``target`` GPU: ``target`` built into ``build_dir``, the HIP
    driver with the emulator's stand-in runtime under it, set up through the monkeypatch ``mp``.
    Returns the emulator module and the stand-in."""
    import torch
    from rdnattention import drivers, replay
    from rdnattention.drivers import hip, module_api
    from rdnattention_gen import build, toolchain

    build.build(matrix, matrix.select(target), build_dir, log=lambda *_: None)
    tc = toolchain.find()
    emu = import_emulator(tinygrad, tc.clang, build_dir / "amd-emulator")
    stand_in = EmulatedHip(emu, tc.objdump, matrix.target(target))
    serve = drivers.for_device
    mp.setattr(drivers, "for_device", lambda d: hip if d.type == "cpu" else serve(d))
    mp.setenv(drivers.TARGET_ENV, target)
    mp.setattr(hip.DRIVER, "_lib", stand_in)
    for cache in ("_modules", "_functions", "_resident"):
        mp.setattr(hip.DRIVER, cache, {})
    mp.setattr(module_api, "current_device", lambda: 0)
    mp.setattr(module_api, "current_stream_handle", lambda index: 0)
    mp.setattr(torch.cuda, "device", _NoContext)
    mp.setattr(torch.cuda, "init", lambda: None)
    mp.setattr(replay, "cache", {})
    return emu, stand_in
