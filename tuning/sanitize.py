"""Representative cuda-platform launches for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool racecheck python -m tuning.sanitize

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
    "decode_gqa4": (1, 8, 2, 1, 3000, 128, {}),  # the 4-row kernel, many slices merged per row chunk
    "rope": (1, 4, 2, 90, 90, 64, {"is_causal": True, "rope": True}),
    "tail": (1, 2, 2, 77, 77, 96, {}),
    "wide": (1, 2, 1, 33, 45, 512, {"is_causal": True}),
}


def cache_cases(device) -> int:
    """The split-KV paths: a paged-cache decode step in slices (merged in the same launch), and a packed batch."""
    from rdnattention import flash_attn_with_kvcache, varlen_attn

    failures = 0
    g = torch.Generator().manual_seed(11)
    pool_k, pool_v = (torch.randn(32, 16, 2, 128, generator=g).half() for _ in range(2))
    table = torch.randperm(32, generator=g).to(torch.int32).view(2, 16)
    q = torch.randn(2, 1, 8, 128, generator=g).half()
    lengths = torch.tensor([250, 17], dtype=torch.int32)
    out = flash_attn_with_kvcache(q.to(device), pool_k.to(device), pool_v.to(device), cache_seqlens=lengths.to(device),
                                  block_table=table.to(device), num_splits=4).cpu()
    for b, n in enumerate(lengths.tolist()):
        rows = torch.arange(n)
        kb = pool_k[table[b].long()[rows // 16], rows % 16].transpose(0, 1).unsqueeze(0)
        vb = pool_v[table[b].long()[rows // 16], rows % 16].transpose(0, 1).unsqueeze(0)
        err = (out[b:b + 1].transpose(1, 2).double() - attention_reference(q[b:b + 1].transpose(1, 2), kb, vb)).abs().max()
        print(f"paged decode batch {b}: max error {err.item():.2e}")
        failures += err.item() > 2e-3
    cu_q, cu_k = torch.tensor([0, 1, 6], dtype=torch.int32), torch.tensor([0, 90, 130], dtype=torch.int32)
    pq = torch.randn(6, 4, 64, generator=g).half()
    pk, pv = (torch.randn(130, 2, 64, generator=g).half() for _ in range(2))
    out = varlen_attn(pq.to(device), pk.to(device), pv.to(device), cu_q.to(device), cu_k.to(device), 5, 90,
                      window_size=(-1, 0), enable_gqa=True, num_splits=3).cpu()
    view = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731
    for b in range(2):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref = attention_reference(view(pq[qs]), view(pk[ks]), view(pv[ks]), is_causal=True)
        err = (view(out[qs]).double() - ref).abs().max()
        print(f"varlen sequence {b}: max error {err.item():.2e}")
        failures += err.item() > 2e-3
    return failures


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
    failures += cache_cases(device)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
