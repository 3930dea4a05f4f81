"""Where an eager call's host time goes: one replayed flash_attn call taken apart, each part timed
alone in a loop (host microseconds per call, the least over rounds), beside torch's SDPA on the
same shapes and the torch and ctypes primitives the parts are made of.

    python -m tuning.launch_parts                      # a GPU: [1, 32, 128, 128] causal, GQA 32/8
    python -m tuning.launch_parts --seq 16 --heads 4   # kernels shorter than the host's work

A part that launches (the whole call, replay.launch, SDPA) is host-bound only where its kernel is
shorter than the host's work: with long kernels the loop measures the GPU. The parts that do not
launch are host time whatever the shape."""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import time

import torch
import torch.nn.functional as F

from rdnattention import flash_attn, ops, replay
from rdnattention.drivers import module_api


def per_call_us(fn, calls: int, rounds: int, sync) -> float:
    """The least over ``rounds`` of the wall time per call of ``calls`` calls, synchronised at the end."""
    fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def parts(device: torch.device, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int) -> dict:
    q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.float16)
    k = torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=torch.float16)
    v = torch.randn_like(k)
    kw = dict(is_causal=True, window_size=(-1, -1), softmax_scale=None, return_lse=False, token_major=False)
    flash_attn(q, k, v, is_causal=True)  # planned and kept
    key = ops.key(q, k, v, **kw)
    r = replay.cache[key]
    out = torch.empty_like(q)
    pointers = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": out.data_ptr()}
    tensors = (q, k, v, None, None, None, None, None)
    lse_like = replay.stand_in(q.shape[:3], torch.float32, q.device)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    index = device.index or 0
    step = r.steps[0]

    def struct_copy():
        args = type(step.args).from_buffer_copy(step.args)
        for field in step.fields:
            setattr(args, field, pointers[field])
        return args

    args = struct_copy()
    driver = r.driver.DRIVER  # the module's ModuleDriver
    launch = getattr(driver._lib, driver.api.launch)
    stream = module_api.current_stream_handle(index)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    native = [ctypes.c_uint(x) for x in (*step.grid, step.block, 1, 1, step.shared_bytes)]
    stream_p = ctypes.c_void_p(stream)
    return {
        "flash_attn (the whole call)": lambda: flash_attn(q, k, v, is_causal=True),
        "torch sdpa (the whole call)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                              enable_gqa=True),
        "ops.key": lambda: ops.key(q, k, v, **kw),
        "replay.pointers": lambda: replay.pointers(tensors, r.reach, 3),
        "torch.empty(q.shape, dtype, device)": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "torch.empty_like(q)": lambda: torch.empty_like(q),
        "q.new_empty(q.shape)": lambda: q.new_empty(q.shape),
        "q.new_empty((b, h, s), dtype=float32)": lambda: q.new_empty(q.shape[:3], dtype=torch.float32),
        "torch.empty_like(replay.stand_in((b, h, s), float32), contiguous)": lambda: torch.empty_like(
            lse_like, memory_format=replay.CONTIGUOUS),
        "torch.empty((b, h, s), dtype=float32, device)": lambda: torch.empty(q.shape[:3], dtype=torch.float32,
                                                                            device=q.device),
        "replay.launch (struct copy, pointers, launch)": lambda: replay.launch(r, dict(pointers), q.device),
        "  the struct copy and its pointers": struct_copy,
        "  the driver's launch_function": lambda: r.driver.launch_function(step.function, step.name, step.index,
                                                                          step.grid, step.block, args,
                                                                          step.shared_bytes),
        "  the launch entry point, Python ints": lambda: launch(step.function, *step.grid, step.block, 1, 1,
                                                                 step.shared_bytes, stream, params, None),
        "  the launch entry point, arguments as ctypes values": lambda: launch(step.function, *native, stream_p,
                                                                            params, None),
        "current stream handle": lambda: module_api.current_stream_handle(index),
        "current device": module_api.current_device,
        "a ctypes call (libc abs)": lambda: libc.abs(-1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="passes over the parts (each part: its least)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: these are the host's parts of a GPU launch")
        return 1
    device = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}; q [{args.batch},{args.heads},"
          f"{args.seq},{args.head_dim}], k/v [{args.batch},{args.kv_heads},{args.seq},{args.head_dim}], causal\n")
    # Each part's least over --repeats passes of the whole list: this host's speed drifts between
    # passes (the same primitive by up to 2x), so compare parts within a run, never across runs.
    with torch.inference_mode():
        calls = parts(device, args.batch, args.heads, args.kv_heads, args.seq, args.head_dim)
        best = {name: float("inf") for name in calls}
        for _ in range(args.repeats):
            for name, fn in calls.items():
                best[name] = min(best[name], per_call_us(fn, args.calls, args.rounds, torch.cuda.synchronize))
    print("| part | host us per call |\n|---|---|")
    for name, us in best.items():
        print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
