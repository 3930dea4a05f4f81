"""One forward launch for a profiler to look at (ncu, compute-sanitizer).

    ncu --clock-control none --section WarpStateStats python3 tuning/profile_one.py 1 32 2048 128
    ncu --clock-control none -k regex:fa2_dec python3 tuning/profile_one.py --decode 1

With --decode N: the decode shape of bench.DECODE row N (split-KV kernels and their combine).
"""

import sys
from pathlib import Path

import torch

from rdnattention import flash_attn

if sys.argv[1] == "--decode":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench import DECODE, decode_inputs

    from rdnattention import dispatch, drivers
    from rdnattention.families import dec

    device = torch.device("cuda")
    _, _, _, call = decode_inputs(DECODE[int(sys.argv[2])], device)
    dec.plan(dispatch.table_for(drivers.target_of(device)), call).run()
else:
    batch, heads, seq, dim = (int(x) for x in sys.argv[1:5])
    causal = len(sys.argv) > 5 and sys.argv[5] == "causal"
    q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.float16) for _ in range(3))
    flash_attn(q, k, v, is_causal=causal)
torch.cuda.synchronize()
