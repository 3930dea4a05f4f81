"""Representative cuda-platform launches for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool racecheck python3 tuning/sanitize.py

Each case is also checked against the float64 oracle; exit status 1 on any mismatch."""

from __future__ import annotations

import sys

import torch

from rdnattention import (attention_reference, flash_attn, flash_attn_int8qk, quantize_per_channel,
                          quantize_per_token, rotary_tables)

# name: (batch, heads_q, heads_kv, seq_q, seq_k, head_dim, options)
CASES = {
    "causal": (1, 2, 2, 150, 150, 128, {"is_causal": True}),
    "window": (1, 2, 2, 140, 140, 64, {"window_size": (21, 9)}),
    "gqa": (1, 4, 2, 97, 97, 128, {"is_causal": True}),
    "decode": (2, 4, 2, 1, 203, 128, {}),
    "rope": (1, 4, 2, 90, 90, 64, {"is_causal": True, "rope": True}),
    "tail": (1, 2, 2, 77, 77, 96, {}),
    "wide": (1, 2, 1, 33, 45, 512, {"is_causal": True}),
}


def main() -> int:
    device = torch.device("cuda")
    failures = 0
    for name, (b, hq, hk, sq, sk, d, options) in CASES.items():
        g = torch.Generator().manual_seed(sq + d)
        q, k, v = (torch.randn(b, h, s, d, generator=g).half() for h, s in ((hq, sq), (hk, sk), (hk, sk)))
        options = dict(options)
        if options.pop("rope", False):
            options["rotary_cos"], options["rotary_sin"] = rotary_tables(sk, d)
        gpu_options = {key: (val.to(device) if isinstance(val, torch.Tensor) else val) for key, val in options.items()}
        out = flash_attn(q.to(device), k.to(device), v.to(device), **gpu_options)
        torch.cuda.synchronize()
        err = (out.cpu().double() - attention_reference(q, k, v, **options)).abs().max().item()
        ok = err <= 2e-3
        failures += not ok
        print(f"{name:8} {list(q.shape)} / {list(k.shape)}  max abs err {err:.2e}  {'ok' if ok else 'FAIL'}")
        if options.get("rotary_cos") is not None or d not in (64, 128):
            continue
        # The INT8 family on the same shape, against the oracle on its dequantized inputs.
        (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
        out = flash_attn_int8qk(*(t.to(device) for t in (qi, ki, vi, qs, ks, vs)), **options)
        torch.cuda.synchronize()
        ref = attention_reference(qi.double() * qs.double()[..., None], ki.double() * ks.double()[..., None],
                                  vi.double() * vs.double()[:, :, None, :], **options)
        rel = ((out.cpu().double() - ref).norm() / ref.norm()).item()
        ok = rel <= 0.03
        failures += not ok
        print(f"{name:8} int8  relative RMS err {rel:.2e}  {'ok' if ok else 'FAIL'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
