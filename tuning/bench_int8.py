"""INT8 against fp16, both ours, on an NVIDIA GPU (cuda platform), in the same run.

    python -m tuning.bench_int8 [--rounds 5]

For each tuning/bench.py shape: the fp16 kernel (flash_attn) and the int8 kernel
(flash_attn_int8qk on inputs quantized beforehand), launches only, interleaved (fp16 then int8,
--rounds times, medians: timing.interleaved_ms). TFLOP/s-equivalent uses the fp16 FLOP count for both; the ratio is
int8 / fp16. Accuracy: tuning/int8_accuracy.py."""

from __future__ import annotations

import argparse

import torch

from rdnattention import plan_flash_attn, plan_flash_attn_int8qk, quantize_per_channel, quantize_per_token

from .bench import SHAPES, flops, shape_inputs
from .timing import interleaved_ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(device)}; torch {torch.__version__}\n")
    print("| shape | causal | fp16 ms | fp16 TFLOP/s | int8 ms | int8 TFLOP/s-eq | int8 / fp16 |")
    print("|---|---|---|---|---|---|---|")
    for label, b, hq, hk, sq, sk, d, causal in SHAPES:
        q, k, v = shape_inputs(b, hq, hk, sq, sk, d, device)
        (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
        plans = {"fp16": plan_flash_attn(q, k, v, is_causal=causal),
                 "int8": plan_flash_attn_int8qk(qi, ki, vi, qs, ks, vs, is_causal=causal)}
        ms = interleaved_ms(plans, args.rounds)
        f = flops(b, hq, sq, sk, d, causal)
        t16, t8 = ms["fp16"], ms["int8"]
        print(f"| {label} | {causal} | {t16:.3f} | {f / t16 / 1e9:.2f} | {t8:.3f} | {f / t8 / 1e9:.2f} | "
              f"{t16 / t8:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
