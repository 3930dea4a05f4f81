"""Accuracy of the INT8 kernel against the float64 oracle, beside the fp16 kernel's.

    python -m tuning.int8_accuracy [--device cpu|cuda]

Inputs: fp16 q, k, v [1, 8, 512, head_dim] (K/V with 4 heads: GQA), N(0, 1), and "outliers":
the same with 4 channels of q and k scaled by 10 (a few large-magnitude channels, as real
activations have). flash_attn_int8qk_quantized quantizes q and k per token and v per channel.
Metrics against attention_reference on the fp16 inputs: max abs error, relative RMS error
(||out - ref|| / ||ref||) and cosine similarity of the flattened outputs."""

from __future__ import annotations

import argparse

import torch

from rdnattention import attention_reference, flash_attn, flash_attn_int8qk_quantized


def inputs(head_dim: int, outliers: bool, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 8, 512, head_dim, generator=g)
    k = torch.randn(1, 4, 512, head_dim, generator=g)
    v = torch.randn(1, 4, 512, head_dim, generator=g)
    if outliers:
        channels = torch.randperm(head_dim, generator=g)[:4]
        q[..., channels] *= 10
        k[..., channels] *= 10
    scale = 1.0 / head_dim ** 0.5 if not outliers else 0.2 / head_dim ** 0.5  # keep the softmax from saturating
    return (t.half().to(device) for t in (q, k, v)), scale


def metrics(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    o, r = out.double().cpu().flatten(), ref.flatten()
    err = (o - r).abs().max().item()
    rel = ((o - r).norm() / r.norm()).item()
    cos = torch.nn.functional.cosine_similarity(o, r, dim=0).item()
    return err, rel, cos


def rows(device: str):
    for head_dim in (64, 128):
        for outliers in (False, True):
            for causal in (False, True):
                (q, k, v), scale = inputs(head_dim, outliers, device)
                ref = attention_reference(q, k, v, is_causal=causal, softmax_scale=scale)
                i8 = metrics(flash_attn_int8qk_quantized(q, k, v, is_causal=causal, softmax_scale=scale), ref)
                f16 = metrics(flash_attn(q, k, v, is_causal=causal, softmax_scale=scale), ref)
                yield head_dim, "outliers" if outliers else "N(0,1)", causal, i8, f16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    print("| head_dim | inputs | causal | int8 max abs | int8 rel RMS | int8 cosine | fp16 max abs | fp16 rel RMS |")
    print("|---|---|---|---|---|---|---|---|")
    for head_dim, kind, causal, (e8, r8, c8), (e16, r16, _) in rows(args.device):
        print(f"| {head_dim} | {kind} | {causal} | {e8:.2e} | {r8:.2e} | {c8:.6f} | {e16:.2e} | {r16:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
