"""Forward fp16 (and bf16) benchmark on an NVIDIA GPU (cuda platform), against peers measured in the same run.

    python -m tuning.bench --out results/

For each shape: the GPU time per call of back-to-back calls (timing.stream_ms: 25 calls between
two CUDA events, median of 5 rounds, after warm-up; the host enqueues the next call while the GPU
runs the last, as in a model's forward pass), TFLOP/s with FLOPs = 4*B*H*Sq*Sk*D (halved for causal when
Sq == Sk), % of the FP32 FMA peak measured here by the probe kernel built into the target's code
object (rdnattention/peak.py), and ratios to torch's math attention in fp32 with TF32 off (no
tensor cores) and to torch's default scaled_dot_product_attention in fp16 (tensor cores;
context), all timed the same way. The "one call" column times single calls with the GPU idle
before each (timing.call_ms: median of 25, events around each call): the host's launch latency
included.
Causal rows also time the launch with row blocks in launch order instead of longest first.
The bf16 section (bench_bf16.md) times the bf16 kernels beside the fp16 ones at the same shapes on
the same values (BF16_SHAPES, and the decode shapes), in turn: the target is the same speed within 5%.
The score transforms (softcap, ALiBi, sinks) are timed against plain attention on the same shapes.
Writes bench.md, bench_decode.md, bench_bf16.md, bench_score.md and bench.png to --out."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rdnattention import dispatch, drivers, flash_attn, plan_flash_attn
from rdnattention.peak import fma_peak_tflops

from .timing import call_ms, graph_ms, interleaved_ms, stream_ms

# (label, batch, heads_q, heads_kv, seq_q, seq_k, head_dim, causal)
SHAPES = [
    ("1x32x2048x128", 1, 32, 32, 2048, 2048, 128, False),
    ("1x32x2048x128", 1, 32, 32, 2048, 2048, 128, True),
    ("1x32x2048x64", 1, 32, 32, 2048, 2048, 64, False),
    ("1x32x2048x64", 1, 32, 32, 2048, 2048, 64, True),
    # head_dims in steps of 8 (Phi-2/3: 80, 96; Stable Diffusion: 40, 80, 160), against 64 above:
    # HEAD_DIM_RATIOS
    ("1x32x2048x80", 1, 32, 32, 2048, 2048, 80, False),
    ("1x32x2048x80", 1, 32, 32, 2048, 2048, 80, True),
    ("1x32x2048x96", 1, 32, 32, 2048, 2048, 96, False),
    ("1x32x2048x96", 1, 32, 32, 2048, 2048, 96, True),
    ("1x32x2048x40", 1, 32, 32, 2048, 2048, 40, False),
    ("4x16x4096x64", 4, 16, 16, 4096, 4096, 64, False),
    ("4x16x4096x64", 4, 16, 16, 4096, 4096, 64, True),
    ("GQA 32/8 S4096 D128", 1, 32, 8, 4096, 4096, 128, False),
    ("GQA 32/8 S4096 D128", 1, 32, 8, 4096, 4096, 128, True),
    ("decode 1/8192 H32 D128", 1, 32, 32, 1, 8192, 128, False),
]
LONG = ("1x32x16384x128", 1, 32, 32, 16384, 16384, 128, True)
# TFLOP/s of these shapes against the same shape at head_dim 64 (the target: at least 0.9 for 80 and 96).
HEAD_DIM_RATIOS = (("1x32x2048x80", "1x32x2048x64"), ("1x32x2048x96", "1x32x2048x64"), ("1x32x2048x40", "1x32x2048x64"))
# Decode: (label, batch, heads_q, heads_kv, seq_q, seq_k, head_dim, page size or None: contiguous)
DECODE = [
    ("decode H32 Sk8192 D128", 1, 32, 32, 1, 8192, 128, None),
    ("decode GQA 32/8 Sk32768 D128", 1, 32, 8, 1, 32768, 128, None),
    ("decode batch 8 H32 Sk8192 D128", 8, 32, 32, 1, 8192, 128, None),
    ("speculative Sq4 H32 Sk8192 D128", 1, 32, 32, 4, 8192, 128, None),
    ("decode H32 Sk8192 D128 paged 16", 1, 32, 32, 1, 8192, 128, 16),
    ("decode H32 Sk8192 D128 paged 256", 1, 32, 32, 1, 8192, 128, 256),
]


def shape_inputs(b, hq, hk, sq, sk, d, device, dtype=torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of one SHAPES row in ``dtype`` (fp16; bf16: the same values rounded to bf16),
    N(0, 1), the same on every run."""
    g = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(b, h, s, d, device=device, dtype=torch.float16, generator=g).to(dtype)
                 for h, s in ((hq, sq), (hk, sk), (hk, sk)))


def alibi_slopes(hq, device) -> torch.Tensor:
    """ALiBi's slopes for ``hq`` heads, as the ALiBi paper gives them for a power of two."""
    return 2.0 ** (-8.0 * torch.arange(1, hq + 1, device=device) / hq)


class SdpaPlan:
    """torch's scaled_dot_product_attention (fp16, its default backend) on q, k, v, with a plan's
    ``run``: a peer to time beside our plans."""

    def __init__(self, q, k, v):
        self.q, self.k, self.v = q, k, v

    def run(self):
        F.scaled_dot_product_attention(self.q, self.k, self.v, enable_gqa=self.k.shape[1] != self.q.shape[1])


def decode_bytes(shape) -> int:
    """K and V bytes a decode call reads."""
    _, b, _, hk, _, sk, d, _ = shape
    return 2 * b * hk * sk * d * 2


def decode_inputs(shape, device, dtype=torch.float16):
    """q, k, v [batch, heads, seq, head_dim] (k, v contiguous, as SDPA reads them) in ``dtype`` and
    the decode call on them; a paged shape holds the same keys in shuffled pages of a [pages, page,
    heads_kv, head_dim] cache read through a block table."""
    from rdnattention.families import dec

    _, b, hq, hk, sq, sk, d, page = shape
    q, k, v = shape_inputs(b, hq, hk, sq, sk, d, device, dtype)
    out = torch.empty_like(q)
    common = dict(q=q, out=out, lse=None, window=(-1, -1), softmax_scale=d ** -0.5, batch=b, seq_q=sq, seq_k=sk)
    if page is None:
        return q, k, v, dec.Call(k=k, v=v, **common)
    pages = b * sk // page
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).to(device)
    block_table = order.view(b, sk // page).to(torch.int32)
    def paged(t):  # [b, hk, sk, d] -> [pages, page, hk, d], page i of batch b at block_table[b, i]
        cache = torch.empty(pages, page, hk, d, dtype=t.dtype, device=device)
        cache[block_table.long().flatten()] = t.transpose(1, 2).reshape(b * sk // page, page, hk, d)
        return cache.transpose(1, 2)
    return q, k, v, dec.Call(k=paged(k), v=paged(v), block_table=block_table, **common)



def flops(b, hq, sq, sk, d, causal) -> float:
    f = 4 * b * hq * sq * sk * d
    return f / 2 if causal and sq == sk else f


def run_shape(shape, device, with_peers=True, reps=25):
    label, b, hq, hk, sq, sk, d, causal = shape
    q, k, v = shape_inputs(b, hq, hk, sq, sk, d, device)
    row = {"shape": label, "causal": causal, "flops": flops(b, hq, sq, sk, d, causal)}
    torch.cuda.reset_peak_memory_stats(device)
    row["ours_ms"] = stream_ms(lambda: flash_attn(q, k, v, is_causal=causal), reps=reps)
    row["ours_peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    row["ours_one_call_ms"] = call_ms(lambda: flash_attn(q, k, v, is_causal=causal), reps=reps)
    if causal and with_peers:  # the same launch with row blocks in launch order, not longest first
        natural = plan_flash_attn(q, k, v, is_causal=causal, heavy_first=False)
        row["natural_ms"] = stream_ms(natural.run, reps=reps)
    if not with_peers:
        return row
    causal_flag = causal and sq == sk
    q32, k32, v32 = q.float(), k.float(), v.float()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gqa = hk != hq
    with sdpa_kernel(SDPBackend.MATH):
        row["math_ms"] = stream_ms(lambda: F.scaled_dot_product_attention(
            q32, k32, v32, is_causal=causal_flag, enable_gqa=gqa), reps=10, rounds=3)
    row["sdpa_ms"] = stream_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal_flag, enable_gqa=gqa))
    return row


def decode_section(device, rounds: int = 7) -> str:
    """The decode table: GB/s (K and V bytes read) of each DECODE shape against torch SDPA (fp16,
    its default backend) on the same contiguous tensors, both replayed from CUDA graphs and timed in
    turn (graph_ms); paged shapes against the contiguous plan of the same keys too. The eager column
    times single calls (interleaved_ms), host launch overhead included. Slices chosen automatically."""
    from rdnattention.families import dec

    lines = [f"GPU: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; decode GB/s counts the K and V "
             "bytes read; kernel times from CUDA-graph replays", "",
             "| shape | ours ms | ours GB/s | slices | sdpa ms | sdpa GB/s | ours / sdpa | paged / contiguous time | "
             "eager ours ms | eager sdpa ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape in DECODE:
        q, k, v, call = decode_inputs(shape, device)
        table = dispatch.table_for(drivers.target_of(device))
        plans = {"ours": dec.plan(table, call), "sdpa": SdpaPlan(q, k, v)}
        if call.block_table is not None:
            plans["contiguous"] = dec.plan(table, dec.Call(**{**call.__dict__, "k": k, "v": v, "block_table": None}))
        ms = graph_ms(plans, rounds)
        eager = interleaved_ms({"ours": plans["ours"], "sdpa": plans["sdpa"]}, rounds)
        gb = decode_bytes(shape) / 1e9
        paged = f"{ms['ours'] / ms['contiguous']:.3f}" if "contiguous" in ms else "-"
        lines.append(f"| {shape[0]} | {ms['ours']:.4f} | {gb / ms['ours'] * 1e3:.0f} | "
                     f"{plans['ours'].launches[0].args.splits} | {ms['sdpa']:.4f} | {gb / ms['sdpa'] * 1e3:.0f} | "
                     f"{ms['sdpa'] / ms['ours']:.2f}x | {paged} | {eager['ours']:.4f} | {eager['sdpa']:.4f} |")
    return "\n".join(lines)


def int8_decode_line(device, rounds: int = 7) -> str:
    """The first DECODE shape with int8 Q, K, V (the i8dec kernels: half the bytes) against the fp16
    decode kernels on the same values, both replayed from CUDA graphs (graph_ms)."""
    from rdnattention import plan_flash_attn, plan_flash_attn_int8qk, quantize_per_channel, quantize_per_token

    shape = DECODE[0]
    q, k, v = shape_inputs(*shape[1:7], device)
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
    ms = graph_ms({"int8": plan_flash_attn_int8qk(qi, ki, vi, qs, ks, vs), "fp16": plan_flash_attn(q, k, v)}, rounds)
    int8_bytes = decode_bytes(shape) / 2 + ks.numel() * 4
    return (f"{shape[0]} with int8 K and V: {ms['int8']:.4f} ms ({int8_bytes / 1e6 / ms['int8']:.0f} GB/s of int8 "
            f"rows and scales), fp16 {ms['fp16']:.4f} ms: {ms['fp16'] / ms['int8']:.2f}x")


# bf16 beside fp16 at the same shapes: the head_dims the bf16 kernels are built for (64, 80, 96,
# 128, 256), full and causal, and GQA.
BF16_SHAPES = [
    *((f"1x32x2048x{d}", 1, 32, 32, 2048, 2048, d, causal) for d in (64, 80, 96, 128) for causal in (False, True)),
    ("1x16x2048x256", 1, 16, 16, 2048, 2048, 256, True),
    ("GQA 32/8 S4096 D128", 1, 32, 8, 4096, 4096, 128, True),
]
BF16_SAME_SPEED = 0.05  # bf16 time within 5% of fp16's


def bf16_section(device, rounds: int = 5) -> str:
    """bf16 against fp16 on the same values (bf16: the fp16 inputs rounded), each shape's two plans
    timed in turn ``rounds`` times: prefill rows back to back (stream_ms), decode rows (DECODE, the
    bf16 dec kernels, their slices merged in the same launch) replayed from CUDA graphs (graph_ms)."""
    from rdnattention.families import dec

    lines = [f"GPU: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; bf16 and fp16 kernels on the "
             f"same values, timed in turn; the target: bf16 time within {BF16_SAME_SPEED:.0%} of fp16's", "",
             "| shape | causal | fp16 ms | bf16 ms | bf16 / fp16 time | within 5% | fp16 kernel | bf16 kernel |",
             "|---|---|---|---|---|---|---|---|"]
    for label, b, hq, hk, sq, sk, d, causal in BF16_SHAPES:
        plans = {dt: plan_flash_attn(*shape_inputs(b, hq, hk, sq, sk, d, device, dt), is_causal=causal)
                 for dt in (torch.float16, torch.bfloat16)}
        times: dict = {dt: [] for dt in plans}
        for _ in range(rounds):
            for dt, p in plans.items():
                times[dt].append(stream_ms(p.run, rounds=1))
        ms = {dt: sorted(t)[len(t) // 2] for dt, t in times.items()}
        ratio = ms[torch.bfloat16] / ms[torch.float16]
        lines.append(f"| {label} | {causal} | {ms[torch.float16]:.3f} | {ms[torch.bfloat16]:.3f} | {ratio:.3f} | "
                     f"{'yes' if abs(ratio - 1) <= BF16_SAME_SPEED else 'NO'} | "
                     f"{plans[torch.float16].launches[0].kernel.name} | {plans[torch.bfloat16].launches[0].kernel.name} |")
    table = dispatch.table_for(drivers.target_of(device))
    for shape in DECODE:
        plans = {dt: dec.plan(table, decode_inputs(shape, device, dt)[3]) for dt in (torch.float16, torch.bfloat16)}
        ms = graph_ms(plans, rounds)
        ratio = ms[torch.bfloat16] / ms[torch.float16]
        lines.append(f"| {shape[0]} | False | {ms[torch.float16]:.4f} | {ms[torch.bfloat16]:.4f} | {ratio:.3f} | "
                     f"{'yes' if abs(ratio - 1) <= BF16_SAME_SPEED else 'NO'} | "
                     f"{plans[torch.float16].launches[0].kernel.name} | {plans[torch.bfloat16].launches[0].kernel.name} |")
    return "\n".join(lines)


def varlen_section(device, rounds: int = 5) -> str:
    """Packed prefill (varlen_attn, the f16 kernels of layout varlen) against flash_attn on the same sequences
    padded into [batch, heads, seq, head_dim], causal, timed in turn."""
    from rdnattention import varlen_attn

    lengths, heads, dim = [2048, 1024, 512, 2048], 32, 128
    g = torch.Generator(device=device).manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, device=device, dtype=torch.float16, generator=g) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    padded = [torch.zeros(len(lengths), heads, max(lengths), dim, device=device, dtype=torch.float16)
              for _ in range(3)]
    for b, n in enumerate(lengths):
        for p, t in zip(padded, (q, k, v)):
            p[b, :, :n] = t[cu[b]:cu[b] + n].transpose(0, 1)

    class Call:
        def __init__(self, fn):
            self.run = fn

    plans = {"packed": Call(lambda: varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), window_size=(-1, 0))),
             "padded": Call(lambda: flash_attn(*padded, is_causal=True))}
    ms = interleaved_ms(plans, rounds)
    f = sum(4 * heads * n * n * dim / 2 for n in lengths)
    return (f"Packed prefill, lengths {lengths}, {heads} heads, head_dim {dim}, causal: varlen_attn "
            f"{ms['packed']:.3f} ms ({f / ms['packed'] / 1e9:.1f} TFLOP/s), flash_attn on the padded batch "
            f"{ms['padded']:.3f} ms")


# Score transforms against plain causal on the same tensors (the target: each at most 5% slower):
# (label, batch, heads_q, heads_kv, seq_q, seq_k, head_dim); prefill rows causal, decode rows on the
# whole cache.
SCORE_SHAPES = [
    ("1x32x2048x128 causal", 1, 32, 32, 2048, 2048, 128),
    ("1x32x2048x64 causal", 1, 32, 32, 2048, 2048, 64),
    # ALiBi models' prefills (the f16 kernels of score option alibi): MPT-7B, bloom-560m
    ("MPT-7B 32/32 S4096 D128 causal", 1, 32, 32, 4096, 4096, 128),
    ("bloom-560m B4 16/16 S1024 D64 causal", 4, 16, 16, 1024, 1024, 64),
    ("Gemma 2 8/4 S4096 D256 causal", 1, 8, 4, 4096, 4096, 256),
    ("gpt-oss 64/8 S4096 D64 causal", 1, 64, 8, 4096, 4096, 64),
    ("decode H32 Sk8192 D128", 1, 32, 32, 1, 8192, 128),
    ("decode GQA 64/8 Sk8192 D64", 1, 64, 8, 1, 8192, 64),
]


def score_transform_section(device, rounds: int = 7) -> str:
    """Each SCORE_SHAPES row plain, with a logit softcap (50), ALiBi slopes (per head), attention
    sinks (per head) and all three, replayed from CUDA graphs and timed in turn (graph_ms); the
    cost of each against plain, in percent (the target: at most 5), and the kernels the ALiBi call
    ran (a prefill: the f16 kernels of score option alibi, where built for the head_dim)."""
    from rdnattention import plan_flash_attn
    from rdnattention.errors import RdnaAttentionError

    lines = [f"GPU: {torch.cuda.get_device_name(device)}; score transforms against plain (softcap and sinks: the "
             "f16 kernels of score option xf where built for the head_dim; ALiBi: those of score option alibi; "
             "else the split-KV kernels, which read all three at run time); kernel times from CUDA-graph replays", "",
             "| shape | plain ms | softcap | ALiBi | sinks | all three | softcap ran | ALiBi ran |",
             "|---|---|---|---|---|---|---|---|"]
    for label, b, hq, hk, sq, sk, d in SCORE_SHAPES:
        q, k, v = shape_inputs(b, hq, hk, sq, sk, d, device)
        causal = sq > 1
        slopes = alibi_slopes(hq, device)
        sinks = torch.randn(hq, device=device)
        options = {"plain": {}, "softcap": {"softcap": 50.0}, "alibi": {"alibi_slopes": slopes},
                   "sinks": {"sinks": sinks}, "all": {"softcap": 50.0, "alibi_slopes": slopes, "sinks": sinks}}
        try:
            plans = {name: plan_flash_attn(q, k, v, is_causal=causal, **kw) for name, kw in options.items()}
        except RdnaAttentionError as e:  # a build without this shape's kernels (a subset): the row says so
            lines.append(f"| {label} | {type(e).__name__}: {str(e)[:100]} | | | | | | |")
            continue
        ms = graph_ms(plans, rounds)
        cost = [f"{100 * (ms[name] / ms['plain'] - 1):+.1f}%" for name in ("softcap", "alibi", "sinks", "all")]
        ran = [", ".join(dict.fromkeys(launch.kernel.kind for launch in plans[name].launches))
               for name in ("softcap", "alibi")]
        lines.append(f"| {label} | {ms['plain']:.4f} | " + " | ".join(cost) + f" | {ran[0]} | {ran[1]} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--decode-only", action="store_true", help="only the decode section")
    parser.add_argument("--bf16-only", action="store_true", help="only the bf16 against fp16 section")
    parser.add_argument("--score-only", action="store_true", help="only the score transforms section")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    if args.score_only:
        score = score_transform_section(device)
        print(score)
        (args.out / "bench_score.md").write_text(score + "\n")
        return 0
    bf16 = bf16_section(device)
    print(bf16)
    (args.out / "bench_bf16.md").write_text(bf16 + "\n")
    if args.bf16_only:
        return 0
    decode = decode_section(device) + "\n\n" + int8_decode_line(device) + "\n\n" + varlen_section(device)
    print(decode)
    (args.out / "bench_decode.md").write_text(decode + "\n")
    score = score_transform_section(device)
    print(score)
    (args.out / "bench_score.md").write_text(score + "\n")
    if args.decode_only:
        return 0
    peak = fma_peak_tflops(device)  # the probe in the target's own code object
    rows = [run_shape(s, device) for s in SHAPES]
    long_row = run_shape(LONG, device, with_peers=False, reps=5)

    def tf(ms, f):
        return f / ms / 1e9

    lines = [f"GPU: {torch.cuda.get_device_name(device)}; measured FP32 FMA peak {peak:.1f} TFLOP/s; "
             f"torch {torch.__version__}", "",
             "| shape | causal | ours ms | ours TFLOP/s | % FMA peak | fp32 math TFLOP/s | ours / math | "
             "sdpa fp16 TFLOP/s | ours / sdpa | in launch order TFLOP/s | ours ms, one call |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours, math_, sdpa = tf(r["ours_ms"], r["flops"]), tf(r["math_ms"], r["flops"]), tf(r["sdpa_ms"], r["flops"])
        r.update(ours_tflops=ours, math_tflops=math_, sdpa_tflops=sdpa)
        natural = f"{tf(r['natural_ms'], r['flops']):.2f}" if "natural_ms" in r else "-"
        lines.append(f"| {r['shape']} | {r['causal']} | {r['ours_ms']:.3f} | {ours:.2f} | {100 * ours / peak:.1f}% | "
                     f"{math_:.2f} | {ours / math_:.2f}x | {sdpa:.1f} | {ours / sdpa:.3f}x | {natural} | "
                     f"{r['ours_one_call_ms']:.3f} |")
    by_shape = {(r["shape"], r["causal"]): r["ours_tflops"] for r in rows}
    ratios = [f"{shape} / {base}{' causal' if causal else ''}: "
              f"{by_shape[(shape, causal)] / by_shape[(base, causal)]:.2f}"
              for shape, base in HEAD_DIM_RATIOS for causal in (False, True)
              if (shape, causal) in by_shape and (base, causal) in by_shape]
    lines += ["", "TFLOP/s against head_dim 64: " + "; ".join(ratios)]
    lines += ["", f"Long sequence {LONG[0]} causal: {long_row['ours_ms']:.1f} ms, "
              f"{tf(long_row['ours_ms'], long_row['flops']):.2f} TFLOP/s, peak memory {long_row['ours_peak_gb']:.2f} GiB "
              "(inputs and output included)"]
    text = "\n".join(lines)
    print(text)
    (args.out / "bench.md").write_text(text + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return 0
    labels = [f"{r['shape']}\n{'causal' if r['causal'] else 'full'}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(14, 5))
    width = 0.27
    ax.bar([i - width for i in x], [r["ours_tflops"] for r in rows], width, label="rdnattention (fp16 in, fp32 FMA)")
    ax.bar(list(x), [r["math_tflops"] for r in rows], width, label="torch math fp32, TF32 off")
    ax.bar([i + width for i in x], [r["sdpa_tflops"] for r in rows], width, label="torch sdpa fp16 (tensor cores)")
    ax.axhline(peak, color="gray", linestyle="--", label=f"FP32 FMA peak {peak:.0f}")
    ax.set_yscale("log")
    ax.set_ylabel("TFLOP/s")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "bench.png", dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
