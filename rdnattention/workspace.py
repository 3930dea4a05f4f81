"""Scratch memory of the split-KV launches (each key slice's partial output and log-sum-exp, which
the combine kernel merges): one workspace per device and stream, reused call after call, grown
when a call needs more.

The rule that makes reuse safe: a workspace belongs to one stream of one device and is used only
by launches on that stream. Launches on one stream run in order, so a call's slices write the
partials after the previous call's combine has read them; a call on another stream uses that
stream's workspace. Growing one frees the old buffer to torch's caching allocator, which hands it
only to later work on the stream it was allocated on (it is allocated with that stream current),
so the launches still reading it finish first. While a CUDA or HIP graph is being captured, the
workspace is not used: the call's scratch is allocated from the graph's memory pool (a fresh
tensor, as any intermediate of a captured op), so a replay, on whatever stream, shares no memory
with eager calls or other graphs. On the host emulator, whose launches return when done, a
workspace belongs to one thread (calls from several threads run at once).

A workspace reused while a launch on another stream still reads it would be a race: never pass
one stream's workspace to launches on another (``scratch`` always takes the current stream's).
``release()`` frees every workspace (the next call allocates again)."""

from __future__ import annotations

import threading

import torch

from .drivers.module_api import current_device, current_stream_handle

_ALIGN = 256  # bytes: each region of a workspace starts on a multiple

_gpu: dict[tuple[int, int], torch.Tensor] = {}  # (device index, stream handle) -> buffer
_host = threading.local()  # .buffer: this thread's buffer on the host emulator


def align(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """A buffer of ``nbytes`` bytes on ``device``, on its current stream: the one allocation of
    scratch memory (workspaces and captured calls alike)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def scratch(device: torch.device, nbytes: int) -> torch.Tensor:
    """A buffer of at least ``nbytes`` bytes for the launches of one call on ``device``'s current
    stream: that stream's workspace, or, while a graph is being captured, a fresh one the caller
    holds until its launches are enqueued."""
    if device.type == "cpu":
        buffer = getattr(_host, "buffer", None)
        if buffer is None or buffer.numel() < nbytes:
            buffer = _host.buffer = allocate(nbytes, device)
        return buffer
    if torch.cuda.is_current_stream_capturing():
        return allocate(nbytes, device)
    index = current_device() if device.index is None else device.index
    key = (index, current_stream_handle(index))
    buffer = _gpu.get(key)
    if buffer is None or buffer.numel() < nbytes:
        with torch.cuda.device(index):
            buffer = _gpu[key] = allocate(nbytes, torch.device("cuda", index))
    return buffer


def release() -> None:
    """Frees every workspace (each stream's on every device, this thread's on the host)."""
    _gpu.clear()
    _host.buffer = None
