"""Tensors between inaccessible pages: a kernel of the host emulator that reads or writes past the
first or last byte a tensor's shape and strides reach faults (SIGSEGV) instead of touching the
memory beside it. Used in a subprocess of its own (tests/runtime/test_bounds.py).

``guarded(t, end=True)`` copies ``t`` into fresh pages with GUARD bytes of no access on each side,
its last byte against the guard after it (``end=False``: its first byte against the guard before
it; a tensor of whole pages touches both). ``guard_allocations()`` makes the runtime's outputs and
split-KV scratch such tensors too."""

from __future__ import annotations

import ctypes
import mmap

import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.restype = ctypes.c_int
_kept: list = []  # the mappings stay for the life of the process
END = True
GUARD = 16 * mmap.PAGESIZE  # a row or page one past a tensor's end lands in it


def _reach(t: torch.Tensor) -> int:
    """Elements from t's first element to its last, by shape and strides."""
    return sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 if t.numel() else 0


def guarded(t: torch.Tensor, end: bool | None = None) -> torch.Tensor:
    end = END if end is None else end
    elements = _reach(t)
    if elements == 0:
        return t.clone()
    nbytes = elements * t.element_size()
    span = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    m = mmap.mmap(-1, span + 2 * GUARD)
    anchor = ctypes.c_char.from_buffer(m)
    base = ctypes.addressof(anchor)
    for start in (base, base + GUARD + span):
        if _libc.mprotect(start, GUARD, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect failed")
    start = base + GUARD + (span - nbytes if end else 0)
    buf = (ctypes.c_char * nbytes).from_address(start)
    _kept.append((m, anchor, buf))
    flat = torch.frombuffer(buf, dtype=t.dtype)
    g = flat.as_strided(t.shape, t.stride())
    g.copy_(t)
    return g


def guard_allocations() -> None:
    """The runtime's outputs (out, lse) and split-KV scratch guarded as they are allocated."""
    from rdnattention import decode, int8, ops, workspace

    def wrap(allocate):
        def allocate_guarded(*args, **kw):
            return tuple(None if t is None else guarded(t) for t in allocate(*args, **kw))
        return allocate_guarded

    ops.allocate = wrap(ops.allocate)
    decode.allocate = wrap(decode.allocate)
    int8._allocate = wrap(int8._allocate)
    scratch = workspace.allocate
    workspace.allocate = lambda nbytes, device: guarded(scratch(nbytes, device))
