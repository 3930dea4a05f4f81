"""One forward launch for a profiler to look at (ncu, compute-sanitizer).

    ncu --clock-control none --section WarpStateStats python -m tuning.profile_one 1 32 2048 128
    ncu --clock-control none -k regex:fa2_dec python -m tuning.profile_one --decode 1

BATCH HEADS SEQ DIM [causal]: fp16 q, k, v of that shape through flash_attn. With --decode N: the
decode shape of bench.DECODE row N (split-KV kernels, their slices merged in the same launch)."""

from __future__ import annotations

import argparse

import torch

from rdnattention import dispatch, drivers, flash_attn
from rdnattention.families import dec

from .bench import DECODE, decode_inputs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", type=int, metavar="N", help="row N of bench.DECODE instead of a prefill shape")
    p.add_argument("shape", nargs="*", metavar="BATCH HEADS SEQ DIM [causal]")
    args = p.parse_args()
    device = torch.device("cuda")
    if args.decode is not None:
        _, _, _, call = decode_inputs(DECODE[args.decode], device)
        dec.plan(dispatch.table_for(drivers.target_of(device)), call).run()
    else:
        if len(args.shape) not in (4, 5) or args.shape[4:] not in ([], ["causal"]):
            p.error(f"expected BATCH HEADS SEQ DIM [causal], got {' '.join(args.shape) or 'nothing'}")
        batch, heads, seq, dim = (int(x) for x in args.shape[:4])
        q, k, v = (torch.randn(batch, heads, seq, dim, device=device, dtype=torch.float16) for _ in range(3))
        flash_attn(q, k, v, is_causal=len(args.shape) == 5)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
