"""Backward-pass benchmark on an NVIDIA GPU (cuda platform), against torch's backward passes in the same run.

    python -m tuning.bench_bwd --out results/

For each shape, the gradients of one forward call are timed with ``torch.autograd.grad`` on the
graph it recorded (so only the backward runs): ours (rdnattention::flash_attn_bwd, the bwd
family's three passes: by default dQ added by atomics, and with ``deterministic=True`` the
passes that sum every gradient in one order) on fp16 (or bf16) inputs; torch's SDPA math backward on the same values in
fp32 with TF32 off (no tensor cores, the peer with the same arithmetic); and torch's default SDPA
backward in fp16 (tensor cores; context). Times are GPU time per call of back-to-back calls
(timing.stream_ms). FLOPs of a backward = 2.5 x the forward's (4*B*H*Sq*Sk*D, halved for causal
when Sq == Sk); % of the FP32 FMA peak measured here by the probe kernel of the target's code
object (rdnattention/peak.py). The memory section gives the peak memory the backward allocates
beyond its inputs, saved tensors and gradients' outputs, at growing sequence lengths: ours O(S),
the math path's O(S^2).
Writes bench_bwd.md to --out."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rdnattention import flash_attn, flash_attn_varlen_func
from rdnattention.peak import fma_peak_tflops

from .bench import flops, shape_inputs
from .timing import stream_ms

# (label, batch, heads_q, heads_kv, seq, head_dim, causal, dtype)
SHAPES = [
    ("1x32x2048x128", 1, 32, 32, 2048, 128, True, torch.float16),   # the goal's shape
    ("1x32x2048x128", 1, 32, 32, 2048, 128, False, torch.float16),
    ("1x32x2048x64", 1, 32, 32, 2048, 64, True, torch.float16),
    ("1x32x2048x96", 1, 32, 32, 2048, 96, True, torch.float16),
    ("GQA 32/8 S2048 D128", 1, 32, 8, 2048, 128, True, torch.float16),
    ("1x32x2048x128 bf16", 1, 32, 32, 2048, 128, True, torch.bfloat16),
    ("4x16x1024x64", 4, 16, 16, 1024, 64, True, torch.float16),
    # Stable Diffusion 1.5's UNet self-attention at 512x512 (latents 64x64, 32x32, 16x16; 8 heads of
    # 40, 80, 160), batch 2: the shapes of LoRA training
    ("SD 1.5 2x8x4096x40", 2, 8, 8, 4096, 40, False, torch.float16),
    ("SD 1.5 2x8x1024x80", 2, 8, 8, 1024, 80, False, torch.float16),
    ("SD 1.5 2x8x256x160", 2, 8, 8, 256, 160, False, torch.float16),
]
GOAL_PEAK = 0.45   # of the FP32 FMA peak at [1,32,2048,128] causal
GOAL_MATH = 2.0    # times faster than torch's fp32 math backward
MEMORY_SEQS = (1024, 2048, 4096, 8192)


def _grad_fn(fwd, q, k, v, dout):
    """A callable running only the backward of ``fwd(q, k, v)`` (recorded once) against ``dout``."""
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fwd(*x)
    return lambda: torch.autograd.grad(out, x, dout, retain_graph=True)


def _ours(causal, deterministic=False):
    return lambda q, k, v: flash_attn(q, k, v, is_causal=causal, deterministic=deterministic)


def _sdpa(causal, gqa):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def bench_shape(shape, device, peak: float) -> str:
    label, b, hq, hk, s, d, causal, dtype = shape
    q, k, v = shape_inputs(b, hq, hk, s, s, d, device, dtype)
    dout = torch.randn_like(q)
    f = 2.5 * flops(b, hq, s, s, d, causal)
    ours = stream_ms(_grad_fn(_ours(causal), q, k, v, dout), reps=10)
    fixed = stream_ms(_grad_fn(_ours(causal, deterministic=True), q, k, v, dout), reps=10)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with sdpa_kernel(SDPBackend.MATH):
        math = stream_ms(_grad_fn(_sdpa(causal, hk != hq), q.float(), k.float(), v.float(), dout.float()),
                         reps=5, rounds=3)
    sdpa = stream_ms(_grad_fn(_sdpa(causal, hk != hq), q, k, v, dout), reps=10)
    tflops = f / ours / 1e9
    return (f"| {label} | {causal} | {ours:.3f} | {tflops:.2f} | {tflops / peak:.1%} | {fixed:.3f} | "
            f"{f / fixed / 1e9 / peak:.1%} | {math:.3f} | {math / ours:.2f}x | {sdpa:.3f} | {sdpa / ours:.2f} |")


def backward_bytes(fwd, q, k, v, dout, device) -> int:
    """Peak bytes allocated while the backward of ``fwd(q, k, v)`` runs, beyond what was allocated
    before it (inputs, the forward's saved tensors) and the three gradients it returns."""
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fwd(*x)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    grads = torch.autograd.grad(out, x, dout)
    torch.cuda.synchronize(device)
    returned = sum(g.numel() * g.element_size() for g in grads)
    return torch.cuda.max_memory_allocated(device) - before - returned


def memory_section(device) -> str:
    lines = ["| seq | ours MiB | math fp32 MiB | sdpa fp16 MiB |", "|---|---|---|---|"]
    for s in MEMORY_SEQS:
        q, k, v = shape_inputs(1, 32, 32, s, s, 128, device)
        dout = torch.randn_like(q)
        ours = backward_bytes(_ours(True), q, k, v, dout, device)
        with sdpa_kernel(SDPBackend.MATH):
            math = backward_bytes(_sdpa(True, False), q.float(), k.float(), v.float(), dout.float(), device)
        sdpa = backward_bytes(_sdpa(True, False), q, k, v, dout, device)
        lines.append(f"| {s} | {ours / 2**20:.1f} | {math / 2**20:.1f} | {sdpa / 2**20:.1f} |")
    return "\n".join(lines)


def options_section(device) -> str:
    """The backward with ALiBi beside the plain one (slopes per head, as bloom's), and packed
    sequences (flash_attn_varlen_func) beside the dense batch of the same sequences: each pair in
    the same run, causal, fp16, head_dim 128, both modes."""
    lines = ["| call | plain / dense ms | with the option ms | ratio | deterministic: plain ms | option ms | ratio |",
             "|---|---|---|---|---|---|---|"]
    q, k, v = shape_inputs(1, 32, 32, 2048, 2048, 128, device, torch.float16)
    dout = torch.randn_like(q)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / 32) for h in range(32)], device=device)
    row = ["ALiBi, 1x32x2048x128"]
    times = []
    for det in (False, True):
        plain = stream_ms(_grad_fn(_ours(True, det), q, k, v, dout), reps=10)
        alibi = stream_ms(_grad_fn(lambda q, k, v: flash_attn(q, k, v, is_causal=True, deterministic=det,
                                                              alibi_slopes=slopes), q, k, v, dout), reps=10)
        times.append((plain, alibi))
    row += [f"{times[0][0]:.3f}", f"{times[0][1]:.3f}", f"{times[0][1] / times[0][0]:.3f}",
            f"{times[1][0]:.3f}", f"{times[1][1]:.3f}", f"{times[1][1] / times[1][0]:.3f}"]
    lines.append("| " + " | ".join(row) + " |")
    # Packed: 4 sequences of 512 rows, against the dense [4, 32, 512, 128] batch.
    b, s = 4, 512
    q, k, v = shape_inputs(b, 32, 32, s, s, 128, device, torch.float16)
    dout = torch.randn_like(q)
    packed = [t.transpose(1, 2).reshape(b * s, 32, 128).contiguous() for t in (q, k, v, dout)]
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=device)
    times = []
    for det in (False, True):
        dense = stream_ms(_grad_fn(_ours(True, det), q, k, v, dout), reps=10)
        varlen = stream_ms(_grad_fn(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=True,
                                                                           deterministic=det),
                                    *packed), reps=10)
        times.append((dense, varlen))
    row = ["packed 4 x 512 (32 heads, D 128) vs dense [4, 32, 512, 128]"]
    row += [f"{times[0][0]:.3f}", f"{times[0][1]:.3f}", f"{times[0][1] / times[0][0]:.3f}",
            f"{times[1][0]:.3f}", f"{times[1][1]:.3f}", f"{times[1][1] / times[1][0]:.3f}"]
    lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    peak = fma_peak_tflops(device)
    lines = [f"GPU: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; FP32 FMA peak (probe) "
             f"{peak:.1f} TFLOP/s; backward FLOPs = 2.5 x forward's; goals at 1x32x2048x128 causal: "
             f">= {GOAL_PEAK:.0%} of peak, >= {GOAL_MATH:.0f}x torch's fp32 math backward", "",
             "| shape | causal | ours ms | ours TFLOP/s | % FP32 peak | deterministic ms | % FP32 peak | "
             "math fp32 ms | math / ours | sdpa fp16 ms (tensor cores) | sdpa / ours |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in SHAPES:
        lines.append(bench_shape(shape, device, peak))
        print(lines[-1], flush=True)
    lines += ["", "The options' cost (same run; ratio: with the option / without):", "", options_section(device)]
    print(lines[-1], flush=True)
    lines += ["", "Memory the backward allocates beyond inputs, saved tensors and returned gradients "
              "(1 x 32 heads x seq x 128, causal):", "", memory_section(device)]
    text = "\n".join(lines)
    print(text)
    (args.out / "bench_bwd.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
