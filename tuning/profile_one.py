"""One forward launch for a profiler to look at (ncu, compute-sanitizer).

    ncu --clock-control none --section WarpStateStats python3 tuning/profile_one.py 1 32 2048 128
"""

import sys

import torch

from rdnattention import flash_attn

batch, heads, seq, dim = (int(x) for x in sys.argv[1:5])
causal = len(sys.argv) > 5 and sys.argv[5] == "causal"
q, k, v = (torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.float16) for _ in range(3))
flash_attn(q, k, v, is_causal=causal)
torch.cuda.synchronize()
