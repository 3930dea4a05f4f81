"""What an HSA code object says about its kernels, read the way the ROCm loader reads it: the
AMDGPU metadata note (msgpack, through pyelftools), each kernel's 64-byte descriptor (the ``.kd``
symbol) and the loadable segments. The audit proves the launch ABI from it; the tests execute the
code objects from it."""

from __future__ import annotations

import hashlib
import io
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

try:
    import msgpack
    from elftools.elf.elffile import ELFFile
except ImportError as e:  # only the amdgcn audit and the AMD tests read code objects; cuda and host builds never do
    _MISSING: str | None = e.name
else:
    _MISSING = None

_NT_AMDGPU_METADATA = 32
_KD_BYTES = 64
# kernel_code_properties bits (LLVM AMDGPUUsage, "Kernel Descriptor"), in the order the user SGPRs
# they enable are laid out, with the SGPRs each takes.
USER_SGPRS = (
    ("private_segment_buffer", 0, 4),
    ("dispatch_ptr", 1, 2),
    ("queue_ptr", 2, 2),
    ("kernarg_segment_ptr", 3, 2),
    ("dispatch_id", 4, 2),
    ("flat_scratch_init", 5, 2),
    ("private_segment_size", 6, 1),
)
_WAVEFRONT_SIZE32 = 1 << 10
_USES_DYNAMIC_STACK = 1 << 11
# compute_pgm_rsrc2 fields
_RSRC2_USER_SGPR_COUNT = (1, 0x1F)
_RSRC2_WORKGROUP_ID = {"x": 7, "y": 8, "z": 9}


class CodeObjectError(ValueError):
    """A file is not an AMDGPU HSA code object this reader understands; the message names it."""


@dataclass(frozen=True)
class KernelDescriptor:
    """The fields of a kernel descriptor that a dispatch depends on (LLVM AMDGPUUsage)."""

    group_segment_fixed_size: int
    private_segment_fixed_size: int
    kernarg_size: int
    entry_offset: int             # kernel_code_entry_byte_offset: code address minus descriptor address
    compute_pgm_rsrc1: int
    compute_pgm_rsrc2: int
    compute_pgm_rsrc3: int
    kernel_code_properties: int

    @classmethod
    def unpack(cls, data: bytes) -> KernelDescriptor:
        if len(data) != _KD_BYTES:
            raise CodeObjectError(f"a kernel descriptor is {_KD_BYTES} bytes, got {len(data)}")
        group, private, kernarg, _, entry = struct.unpack_from("<IIIIq", data, 0)
        rsrc3, rsrc1, rsrc2, props = struct.unpack_from("<IIIH", data, 44)
        return cls(group, private, kernarg, entry, rsrc1, rsrc2, rsrc3, props)

    @property
    def wave_size(self) -> int:
        return 32 if self.kernel_code_properties & _WAVEFRONT_SIZE32 else 64

    @property
    def uses_dynamic_stack(self) -> bool:
        return bool(self.kernel_code_properties & _USES_DYNAMIC_STACK)

    @property
    def user_sgprs(self) -> tuple[tuple[str, int], ...]:
        """The enabled user SGPRs in hardware order: (what, how many SGPRs)."""
        return tuple((name, n) for name, bit, n in USER_SGPRS if self.kernel_code_properties >> bit & 1)

    @property
    def user_sgpr_count(self) -> int:
        """compute_pgm_rsrc2.USER_SGPR: the SGPRs the dispatch preloads before the workgroup ids."""
        shift, mask = _RSRC2_USER_SGPR_COUNT
        return self.compute_pgm_rsrc2 >> shift & mask

    def workgroup_ids(self) -> tuple[str, ...]:
        """The workgroup ids (x, y, z) the dispatch writes into SGPRs after the user SGPRs."""
        return tuple(axis for axis, bit in _RSRC2_WORKGROUP_ID.items() if self.compute_pgm_rsrc2 >> bit & 1)


@dataclass(frozen=True)
class Segment:
    vaddr: int
    data: bytes      # the file bytes; memory beyond them up to mem_size is zero
    mem_size: int


class CodeObject:
    """One HSA code object, from its bytes."""

    def __init__(self, data: bytes, name: str = "code object"):
        if _MISSING:
            raise ImportError(f"reading AMD code objects needs pyelftools and msgpack ({_MISSING} is missing): "
                              "pip install 'rdnattention[gen]'")
        self.data, self.name = data, name
        if data[:4] != b"\x7fELF":
            raise CodeObjectError(f"{name}: not an ELF file")
        try:
            self._elf = ELFFile(io.BytesIO(data))
        except Exception as e:  # pyelftools raises its own and struct errors on truncated files
            raise CodeObjectError(f"{name}: unreadable ELF ({type(e).__name__}: {e})") from None
        if self._elf.header.e_machine != "EM_AMDGPU":
            raise CodeObjectError(f"{name}: ELF machine {self._elf.header.e_machine}, not EM_AMDGPU")

    @classmethod
    def read(cls, path: Path) -> CodeObject:
        return cls(Path(path).read_bytes(), str(path))

    def code_digest(self) -> str:
        """A digest of every section but the notes, with its name and address: the machine code
        and the symbols naming it. Code objects assembled from one compile for several targets of
        one instruction set (gfx1030-gfx1036) differ only in their notes and the ELF header."""
        digest = hashlib.sha256()
        for section in self._elf.iter_sections():
            if section["sh_type"] != "SHT_NOTE":
                data = b"" if section["sh_type"] == "SHT_NOBITS" else section.data()
                digest.update(f"{section.name}\0{section['sh_addr']}\0{len(data)}\0".encode() + data)
        return digest.hexdigest()

    @property
    def elf_abi_version(self) -> int:
        """e_ident[EI_ABIVERSION]: 2, 3, 4 for code object v4, v5, v6."""
        return self.data[8]

    @cached_property
    def metadata(self) -> dict:
        """The NT_AMDGPU_METADATA note, decoded (amdhsa.version, amdhsa.target, amdhsa.kernels)."""
        for segment in self._elf.iter_segments():
            if segment["p_type"] != "PT_NOTE":
                continue
            for note in segment.iter_notes():
                if note["n_name"] == "AMDGPU" and note["n_type"] == _NT_AMDGPU_METADATA:
                    desc = note["n_desc"]
                    return msgpack.unpackb(desc if isinstance(desc, bytes) else desc.encode("latin-1"))
        raise CodeObjectError(f"{self.name}: no AMDGPU metadata note (NT_AMDGPU_METADATA)")

    @cached_property
    def kernels(self) -> dict[str, dict]:
        """Each kernel's metadata map (.args, .kernarg_segment_size, ...) by kernel name."""
        return {k[".name"]: k for k in self.metadata.get("amdhsa.kernels", [])}

    @cached_property
    def symbols(self) -> dict[str, int]:
        """Dynamic symbols (what the loader resolves) by name: their virtual addresses."""
        table = self._elf.get_section_by_name(".dynsym")
        if table is None:
            raise CodeObjectError(f"{self.name}: no .dynsym section")
        return {s.name: s["st_value"] for s in table.iter_symbols() if s.name}

    def descriptor_address(self, kernel: str) -> int:
        symbol = self.kernels[kernel][".symbol"] if kernel in self.kernels else f"{kernel}.kd"
        try:
            return self.symbols[symbol]
        except KeyError:
            raise CodeObjectError(f"{self.name}: no kernel descriptor symbol {symbol}") from None

    def descriptor(self, kernel: str) -> KernelDescriptor:
        return KernelDescriptor.unpack(self.read_vaddr(self.descriptor_address(kernel), _KD_BYTES))

    @cached_property
    def segments(self) -> tuple[Segment, ...]:
        """The PT_LOAD segments, as a loader maps them."""
        return tuple(Segment(s["p_vaddr"], s.data(), s["p_memsz"])
                     for s in self._elf.iter_segments() if s["p_type"] == "PT_LOAD")

    def read_vaddr(self, vaddr: int, size: int) -> bytes:
        for s in self.segments:
            if s.vaddr <= vaddr and vaddr + size <= s.vaddr + len(s.data):
                return s.data[vaddr - s.vaddr:vaddr - s.vaddr + size]
        raise CodeObjectError(f"{self.name}: {size} bytes at 0x{vaddr:x} are not in a loaded segment")
