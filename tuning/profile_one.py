"""One forward launch for a profiler to look at (ncu, compute-sanitizer).

    ncu --clock-control none --section WarpStateStats python -m tuning.profile_one 1 32 2048 128
    ncu --clock-control none -k regex:fa2_dec python -m tuning.profile_one --decode 1
    ncu --clock-control none python -m tuning.profile_one --decode-shape 1 32 8 1 8192 128 --sdpa
    ncu --clock-control none -k regex:fa2_bwd python -m tuning.profile_one --backward 1 32 2048 128 causal

BATCH HEADS SEQ DIM [causal]: fp16 q, k, v of that shape through flash_attn. With --decode N: the
decode shape of bench.DECODE row N (split-KV kernels, their slices merged in the same launch); with
--decode-shape BATCH HEADS_Q HEADS_KV SEQ_Q SEQ_K DIM, that decode shape. --sdpa: torch's
scaled_dot_product_attention on the same tensors after ours (its default backend, GQA by
enable_gqa), so that one profile holds both; --softcap C: the call with that logit softcap (a
prefill shape's takes the kernels of score option xf where they are built).
--backward: the prefill shape's forward, then its backward (the bwd family's passes) once."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from rdnattention import dispatch, drivers, flash_attn
from rdnattention.families import dec

from .bench import DECODE, decode_inputs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, metavar="N", help="row N of bench.DECODE instead of a prefill shape")
    p.add_argument("--decode-shape", type=int, nargs=6, metavar=("BATCH", "HEADS_Q", "HEADS_KV", "SEQ_Q", "SEQ_K", "DIM"),
                   help="a decode shape instead of a prefill shape")
    p.add_argument("--sdpa", action="store_true", help="torch's SDPA on the same tensors after ours")
    p.add_argument("--softcap", type=float, default=0.0, help="the call's logit softcap (0: none)")
    p.add_argument("--backward", action="store_true", help="the prefill shape's backward after its forward")
    p.add_argument("shape", nargs="*", metavar="BATCH HEADS SEQ DIM [causal]")
    args = p.parse_args()
    device = torch.device("cuda")
    if args.decode is not None or args.decode_shape is not None:
        row = DECODE[args.decode] if args.decode is not None else ("shape", *args.decode_shape, None)
        q, k, v, call = decode_inputs(row, device)
        if args.softcap:
            call = dataclasses.replace(call, softcap=args.softcap)
        dec.plan(dispatch.table_for(drivers.target_of(device)), call).run()
        causal = False
    else:
        if len(args.shape) not in (4, 5) or args.shape[4:] not in ([], ["causal"]):
            p.error(f"expected BATCH HEADS SEQ DIM [causal], got {' '.join(args.shape) or 'nothing'}")
        batch, heads, seq, dim = (int(x) for x in args.shape[:4])
        q, k, v = (torch.randn(batch, heads, seq, dim, device=device, dtype=torch.float16,
                               requires_grad=args.backward) for _ in range(3))
        causal = len(args.shape) == 5
        out = flash_attn(q, k, v, is_causal=causal, softcap=args.softcap)
        if args.backward:
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
            q, k, v = (t.detach() for t in (q, k, v))
    if args.sdpa:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
