"""The oracle sweep's cases, from the matrix: every head_dim of a family x every case it declares
(rdnattention_gen/families/<family>.py: oracle_cases), so a new family or head_dim is swept
without editing the tests."""

import torch

from rdnattention import rotary_tables
from rdnattention_gen.families import family
from rdnattention_gen.matrix import load_matrix

FAMILY = family("f16")
HEAD_DIMS = list(load_matrix().kernels["f16"]["head_dims"])
VARIANTS = list(FAMILY.oracle_cases)
TOL = 2e-3      # output: fp16 rounding of the result, of the probabilities and (RoPE) of rotated Q/K
LSE_TOL = 2e-3  # log-sum-exp, fp32


def make_case(name, head_dim):
    case = FAMILY.oracle_cases[name]
    g = torch.Generator().manual_seed(head_dim * 100 + VARIANTS.index(name))
    q = torch.randn(case.batch, case.heads_q, case.seq_q, head_dim, generator=g).half()
    k = torch.randn(case.batch, case.heads_kv, case.seq_k, head_dim, generator=g).half()
    v = torch.randn(case.batch, case.heads_kv, case.seq_k, head_dim, generator=g).half()
    options = dict(case.options)
    if options.pop("rope", False):
        # Partial rotation where head_dim allows it, rotate-half and interleaved alternating.
        rotary_dim = head_dim if head_dim <= 64 else head_dim // 2
        options["rotary_cos"], options["rotary_sin"] = rotary_tables(case.seq_k + 3, rotary_dim)
        options["rotary_interleaved"] = head_dim % 64 == 0
    return q, k, v, options


def mirrored_kernels(families: tuple[str, ...]) -> list[tuple[str, str]]:
    """(host target, kernel) for every alternate of ``families`` the host targets build as mirrors
    of GPU targets' tiles (host: the AMD tables; host_f32: sm_90's tuned tiles)."""
    m = load_matrix()
    return sorted((t, v.spec.name) for t in ("host", "host_f32") for v in m.variants_for(m.target(t))
                  if v.priority < 0 and v.spec.family in families)
