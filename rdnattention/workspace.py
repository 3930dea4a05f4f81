"""Scratch memory of the split-KV launches (each key slice's partial output and log-sum-exp, which
the last slice of a row chunk merges) and their counters (uint32, one per row chunk, K/V head and
batch, by which that last slice knows it is last): one workspace and one counter buffer per device
and stream, reused call after call, grown when a call needs more. The counters are zero when
allocated, and every launch leaves the ones it counted in at zero (the last slice resets its
own), so each launch finds them zero whatever ran before on the stream.

The rule that makes reuse safe: a workspace belongs to one stream of one device and is used only
by launches on that stream. Launches on one stream run in order, so a call's slices write the
partials after the previous call's merge has read them; a call on another stream uses that
stream's workspace. Growing one frees the old buffer to torch's caching allocator, which hands it
only to later work on the stream it was allocated on (it is allocated with that stream current),
so the launches still reading it finish first. While a CUDA or HIP graph is being captured, the
workspace is not used: the call's scratch and counters are allocated from the graph's memory
pool (fresh tensors, as any intermediate of a captured op; the counters zeroed by the graph), so a
replay, on whatever stream, shares no memory with eager calls or other graphs. On the host
emulator, whose launches return when done, a workspace belongs to one thread (calls from several
threads run at once).

A workspace reused while a launch on another stream still reads it would be a race: never pass
one stream's workspace to launches on another (``scratch`` always takes the current stream's).
``release()`` frees every workspace (the next call allocates again)."""

from __future__ import annotations

import contextlib
import threading

import torch

from .drivers.module_api import current_device, current_stream_handle

_ALIGN = 256  # bytes: each region of a workspace starts on a multiple

_gpu: dict[tuple[int, int], list] = {}  # (device index, stream handle) -> [scratch, counters]
_host = threading.local()  # .buffers: this thread's [scratch, counters] on the host emulator


def align(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """A buffer of ``nbytes`` bytes on ``device``, on its current stream: the one allocation of
    scratch memory (workspaces and captured calls alike)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def allocate_counters(count: int, device: torch.device) -> torch.Tensor:
    """``count`` split-KV counters on ``device``, zero, on its current stream."""
    return torch.zeros(count, dtype=torch.int32, device=device)


def scratch(device: torch.device, nbytes: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer of at least ``nbytes`` bytes and at least ``count`` counters (zero) for the launches
    of one call on ``device``'s current stream: that stream's workspace and counters (every launch
    leaves them zero), or, while a graph is being captured, fresh ones the caller holds until its
    launches are enqueued."""
    if device.type != "cpu":
        index = current_device() if device.index is None else device.index
        return stream_scratch(index, current_stream_handle(index), nbytes, count)
    return host_scratch(device, nbytes, count)


def host_scratch(device: torch.device, nbytes: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scratch on the host emulator (``device``: a CPU): this thread's workspace and counters."""
    held = getattr(_host, "buffers", None)
    if held is not None:
        buffer, counters = held
        if buffer is not None and counters is not None and buffer.numel() >= nbytes and counters.numel() >= count:
            return buffer, counters
    else:
        held = _host.buffers = [None, None]
    return _grown(held, None, device, nbytes, count)


def stream_scratch(index: int, stream: int, nbytes: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scratch for GPU ``index`` whose current stream is ``stream`` (its handle), which the caller
    looked up already."""
    if capturing():
        where = torch.device("cuda", index)
        with torch.cuda.device(index):
            return allocate(nbytes, where), allocate_counters(count, where)
    held = _gpu.get((index, stream))
    if held is None:
        held = _gpu[(index, stream)] = [None, None]
    return _grown(held, index, None, nbytes, count)


# Whether the current CUDA/HIP stream is being captured into a graph: torch's test without its Python
# wrapper (the public call where absent)
capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _grown(held: list, index: int | None, device: torch.device | None, nbytes: int,
           count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``held`` ([scratch, counters]), each grown to ``nbytes`` and ``count`` where smaller: on GPU
    ``index`` (with it current, so on its current stream), or on ``device`` (the host's)."""
    buffer, counters = held
    if buffer is None or buffer.numel() < nbytes or counters is None or counters.numel() < count:
        with contextlib.nullcontext() if index is None else torch.cuda.device(index):  # on the stream's device
            where = device if index is None else torch.device("cuda", index)
            if buffer is None or buffer.numel() < nbytes:
                buffer = held[0] = allocate(nbytes, where)
            if counters is None or counters.numel() < count:
                counters = held[1] = allocate_counters(count, where)
    return buffer, counters


def release() -> None:
    """Frees every workspace and counter buffer (each stream's on every device, this thread's on the
    host)."""
    _gpu.clear()
    _host.buffers = None
