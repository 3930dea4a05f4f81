"""The INT8 entry points' quantization on a GPU: quantize_per_token and quantize_per_channel (one
launch of the quant kernel each, replayed) against the torch formula they replaced
(int8._torch_quantize: about ten launches a tensor), in one process, round after round, and
flash_attn_int8qk_quantized whole (one quant launch for q, k and v, then the attention) beside torch
SDPA on the same fp16 inputs.

    python -m tuning.quantize [--rounds 5]

Per shape (q [1, 32, seq, 128], k and v [1, 8, seq, 128], fp16):
- GPU time (CUDA events around a CUDA graph of calls: the kernels alone) of the quantization of q,
  k and v (seq 1: a decode step over 8192 keys);
- back-to-back wall time per call (host_us; the least over rounds) and one-call time (one_call_us;
  the median): the quantization alone, and flash_attn_int8qk_quantized against sdpa."""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

H, HKV, D = 32, 8, 128
SEQS = (1, 128, 2048)


def graph_ms(fn, calls: int = 20, rounds: int = 5) -> float:
    """GPU time per call of ``fn`` from a CUDA graph of ``calls`` calls, median over ``rounds``
    replays: the kernels alone, no host work."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm: kernel handles loaded, replays kept
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import rdnattention
    from rdnattention import int8

    from .timing import host_us, one_call_us

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    device, sync = torch.device("cuda"), torch.cuda.synchronize
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}\n")
    print("| q seq / k seq | quantize q, k, v: GPU ms (graph), formula | quant kernel | ratio "
          "| back-to-back us, formula | quant kernel | one call us, formula | quant kernel "
          "| quantized attention: back-to-back us | sdpa | one call us | sdpa |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        for seq in SEQS:
            seq_q = seq if seq > 1 else 1
            seq_k = seq if seq > 1 else 8192
            q = torch.randn(1, H, seq_q, D, device=device, generator=g).half()
            k, v = (torch.randn(1, HKV, seq_k, D, device=device, generator=g).half() for _ in range(2))

            def formula():
                return (int8._torch_quantize("q", q, -1), int8._torch_quantize("k", k, -1),
                        int8._torch_quantize("v", v, 2))

            def kernel():  # the public quantizers (replayed after the first call): three launches
                return {"q": rdnattention.quantize_per_token(q), "k": rdnattention.quantize_per_token(k),
                        "v": rdnattention.quantize_per_channel(v)}

            def ours():
                return rdnattention.flash_attn_int8qk_quantized(q, k, v, is_causal=seq_q > 1)

            def sdpa():
                return F.scaled_dot_product_attention(q, k, v, is_causal=seq_q > 1, enable_gqa=True)

            got, want = kernel(), formula()
            for (a, sa), (b, sb) in zip(got.values(), want):
                assert torch.equal(a, b) and torch.equal(sa, sb), "the quant kernel differs from the formula"
            want = (int8._torch_quantize("q", q.cpu(), -1), int8._torch_quantize("k", k.cpu(), -1),
                    int8._torch_quantize("v", v.cpu(), 2))
            for (a, sa), (b, sb) in zip(got.values(), want):
                assert torch.equal(a.cpu(), b) and torch.equal(sa.cpu(), sb), "the quant kernel differs on the CPU"
            calls, reps, warmup = (200, 200, 50) if seq <= 128 else (20, 30, 5)
            rows = {name: [] for name in ("fk", "kk", "fb", "kb", "f1", "k1", "ob", "sb", "o1", "s1")}
            for _ in range(args.rounds):
                rows["fk"].append(graph_ms(formula))
                rows["kk"].append(graph_ms(kernel))
                rows["fb"].append(host_us(formula, calls, sync, warmup))
                rows["kb"].append(host_us(kernel, calls, sync, warmup))
                rows["f1"].append(one_call_us(formula, sync, reps))
                rows["k1"].append(one_call_us(kernel, sync, reps))
                rows["ob"].append(host_us(ours, calls, sync, warmup))
                rows["sb"].append(host_us(sdpa, calls, sync, warmup))
                rows["o1"].append(one_call_us(ours, sync, reps))
                rows["s1"].append(one_call_us(sdpa, sync, reps))
            med = {k: statistics.median(v) for k, v in rows.items()}
            least = {k: min(v) for k, v in rows.items()}
            print(f"| {seq_q} / {seq_k} | {med['fk']:.4f} | {med['kk']:.4f} | {med['fk'] / med['kk']:.1f}x "
                  f"| {least['fb']:.1f} | {least['kb']:.1f} | {med['f1']:.1f} | {med['k1']:.1f} "
                  f"| {least['ob']:.1f} | {least['sb']:.1f} | {med['o1']:.1f} | {med['s1']:.1f} |")
    print(f"\nint8.counts(): {int8.counts()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
