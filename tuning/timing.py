"""GPU timing for the tuning scripts, one helper per way of timing. The two primitives the runtime
and the tuner share (back-to-back calls between two events, a CUDA-graph capture) stay in
rdnattention/peak.py, which cannot import tuning/; everything here builds on them.

- ``call_ms``: single calls, the GPU idle before each, events around each: launch latency included.
- ``stream_ms``: back-to-back calls between two events: kernel time, host work overlapped.
- ``graph_ms``: plans replayed from CUDA graphs, timed in turn: kernel time, no launch overhead.
- ``interleaved_ms``: plans timed in turn with ``call_ms``, round after round (A B A B ...).
- ``host_us``: the wall clock around a loop of calls: the host's cost per call.
- ``issue_us``: the wall clock until a loop of calls has returned, the device not waited for: the
  host's cost per call where the kernels are longer.
- ``one_call_us``: the wall clock around one call and a synchronisation, the device idle before it.
- ``cold_us``: the host time of one call made after an ``Evictor`` emptied the processor's caches.
- ``kernel_us``: the GPU's time per call, every kernel a call ran, from torch.profiler: calls that
  cannot be replayed from a graph (their inputs change per call) and torch's own kernels alike."""

from __future__ import annotations

import statistics
import time

import torch

from rdnattention.peak import graphed
from rdnattention.peak import time_ms as back_to_back_ms


def call_ms(fn, reps: int = 25, warmup: int = 3) -> float:
    """Median over ``reps`` single calls of ``fn`` of the CUDA-event time around each, after
    ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def stream_ms(fn, reps: int = 25, warmup: int = 3, rounds: int = 5) -> float:
    """GPU time per call of ``reps`` back-to-back calls between two events (no sync between calls;
    peak.time_ms), median over ``rounds``: kernel time, the host's per-call work overlapped."""
    device = torch.device("cuda")
    per_call = [back_to_back_ms(fn, device, reps=reps, warmup=warmup if r == 0 else 0) for r in range(rounds)]
    return statistics.median(per_call)


def graph_ms(plans: dict, rounds: int, calls: int = 20) -> dict:
    """Median ms per call of each plan replayed from a CUDA graph of ``calls`` calls, the plans
    timed in turn ``rounds`` times: kernel time without the host's launch overhead, which for a
    decode call is longer than the kernels (serving engines replay decode steps as graphs)."""
    replays = {key: graphed(plan.run, torch.device("cuda"), calls) for key, plan in plans.items()}
    times: dict = {key: [] for key in plans}
    for _ in range(rounds):
        for key, replay in replays.items():
            times[key].append(call_ms(replay, reps=1, warmup=1) / calls)
    return {key: statistics.median(t) for key, t in times.items()}


def interleaved_ms(plans: dict, rounds: int, reps: int = 10) -> dict:
    """Median ms per plan over ``rounds`` rounds, each timing every plan in turn (``call_ms`` of
    ``reps`` launches each), so drift on the machine falls on every plan alike."""
    times: dict = {key: [] for key in plans}
    for _ in range(rounds):
        for key, plan in plans.items():
            times[key].append(call_ms(plan.run, reps=reps))
    return {key: statistics.median(t) for key, t in times.items()}


def host_us(fn, calls: int, sync, warmup: int = 50) -> float:
    """Microseconds of wall clock per call of ``fn`` over ``calls`` calls with one ``sync()`` at the
    end, after ``warmup`` calls: on a GPU the host's cost per call once it exceeds the kernel's."""
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def issue_us(fn, calls: int, sync, rounds: int = 5, warmup: int = 20) -> float:
    """Microseconds per call until ``calls`` calls of ``fn`` made back to back have returned, the
    device not waited for inside the loop (synchronised before it and after it, untimed), least over
    ``rounds``: the host's own cost per call where its caches are warm, whether or not the kernels
    are longer. ``calls`` must stay below what a launch queue holds, so that no launch waits for the
    device (a hundred or so)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
        sync()
    return best / calls * 1e6


class Evictor:
    """What pushes a call's code and data out of the processor's caches between calls, as a model's
    other operations do between its attention calls: a pass over 64 MiB of memory and over the
    fields of 30,000 Python objects (one call of it takes milliseconds)."""

    def __init__(self) -> None:
        self._memory = torch.ones(16 << 20)  # 64 MiB, on the CPU
        self._objects = [{"a": i, "b": str(i)} for i in range(30_000)]

    def __call__(self) -> int:
        self._memory.add_(1.0)
        return sum(o["a"] for o in self._objects)


def cold_us(fn, sync, evict: Evictor, calls: int = 200, warmup: int = 20) -> float:
    """Median microseconds until one call of ``fn`` returns (its host cost, not its kernels'), each
    call made after ``evict()`` and with the device idle: the host cost of a call between a
    model's other operations (generate()), which a loop of calls keeps in the caches and hides."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        sync()
        evict()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    sync()
    return statistics.median(times)


def one_call_us(fn, sync, reps: int = 200, warmup: int = 5) -> float:
    """Median microseconds of wall clock around one call of ``fn`` and a ``sync()``, the device
    idle before each (synchronised first): the latency a step that waits for its result pays."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def kernel_us(fn, calls: int = 50) -> float:
    """Microseconds of GPU time per call of ``fn``: every kernel its calls ran, as torch.profiler's
    CUDA activity (CUPTI) records them, kernels launched through the driver API included."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls
