"""The FP32 FMA peak of the device at hand, the figure benchmarks and the tuner divide by: a probe
kernel (``rdna_fma_peak``, templates/fma_peak.hip.j2) built into every target's code object by the
project's own toolchain, launched through the same driver as the attention kernels (CUDA, HIP, or
the host emulator, where the figure means nothing), and the two timing primitives the tuner and
tuning/timing.py build on (``time_ms``: back-to-back calls; ``graphed``: a CUDA-graph replay)."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

from .abi import ArgStruct

if TYPE_CHECKING:  # the generator renders the probe from ARGS without torch
    import torch

KERNEL = "rdna_fma_peak"
THREADS = 256
CHAINS, UNROLL = 8, 32  # independent FMA chains per thread, FMAs per chain per iteration
ARGS = ArgStruct("RdnaFmaPeakArgs", (
    ("out", "float*"),    # written only if the sum hits a value it never does: keeps the chains alive
    ("mul", "float"),
    ("add", "float"),
    ("iters", "int"),
))


def fma_peak_tflops(device: torch.device, iters: int = 4096, reps: int = 20) -> float:
    """Median TFLOP/s (2 per FMA) of the probe over ``reps`` launches of 8 workgroups per SM/CU."""
    import torch

    from . import drivers, route

    table = route.device_table(device)
    driver = drivers.for_device(device)
    out = torch.zeros(1, device=device)
    args = ARGS.ctype(out=out.data_ptr(), mul=0.9999, add=1e-4, iters=iters)
    units = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    grid = (units * 8, 1, 1)

    def launch() -> None:
        driver.launch_kernel(table.code_object, KERNEL, grid, THREADS, args, device)

    launch()  # load and warm up
    ms = statistics.median(time_ms(launch, device, reps=1, warmup=0) for _ in range(reps))
    flops = 2 * CHAINS * UNROLL * iters * grid[0] * THREADS
    return flops / ms / 1e9


def time_ms(fn, device: "torch.device", reps: int = 10, warmup: int = 1) -> float:
    """Milliseconds per call of ``fn`` over ``reps`` calls after ``warmup`` ones: CUDA events on a
    GPU (torch's current stream), the wall clock on the host emulator (its launches return when done)."""
    import torch

    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) * 1e3 / reps
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def graphed(fn, device: "torch.device", calls: int = 20):
    """``calls`` calls of ``fn`` captured into one CUDA (or HIP) graph, after one warm-up call
    outside the capture; returns the graph's replay: timing it times the kernels without the
    host's launch overhead, which for a decode call is longer than the kernels."""
    import torch

    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay
