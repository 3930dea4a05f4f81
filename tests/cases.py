"""Shared fp16 feature sweep: 16 head_dims x 9 variants, used on the host and the cuda platform."""

import torch

from rdnattention import rotary_tables

HEAD_DIMS = list(range(32, 513, 32))
TOL = 2e-3      # output: fp16 rounding of the result, of the probabilities and (RoPE) of rotated Q/K
LSE_TOL = 2e-3  # log-sum-exp, fp32

# name: (batch, heads_q, heads_kv, seq_q, seq_k, options)
VARIANTS = {
    "plain": (2, 2, 2, 100, 100, {}),
    "causal": (1, 2, 2, 150, 150, {"is_causal": True}),
    "window_left": (1, 2, 2, 150, 150, {"is_causal": True, "window_size": (37, -1)}),
    "window_two_sided": (1, 2, 2, 140, 140, {"window_size": (21, 9)}),
    "gqa": (1, 4, 2, 97, 97, {"is_causal": True}),
    "mqa": (1, 3, 1, 80, 80, {}),
    "cross": (1, 2, 2, 45, 170, {"is_causal": True}),
    "decode": (2, 4, 2, 1, 203, {}),
    "rope": (1, 4, 2, 90, 90, {"is_causal": True, "rope": True}),
}


def make_case(name, head_dim):
    b, hq, hk, sq, sk, options = VARIANTS[name]
    g = torch.Generator().manual_seed(head_dim * 100 + list(VARIANTS).index(name))
    q = torch.randn(b, hq, sq, head_dim, generator=g).half()
    k = torch.randn(b, hk, sk, head_dim, generator=g).half()
    v = torch.randn(b, hk, sk, head_dim, generator=g).half()
    options = dict(options)
    if options.pop("rope", False):
        # Partial rotation where head_dim allows it, rotate-half and interleaved alternating.
        rotary_dim = head_dim if head_dim <= 64 else head_dim // 2
        options["rotary_cos"], options["rotary_sin"] = rotary_tables(sk + 3, rotary_dim)
        options["rotary_interleaved"] = head_dim % 64 == 0
    return q, k, v, options
