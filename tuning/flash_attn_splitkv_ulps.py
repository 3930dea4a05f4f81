"""Two cases of flash-attn's ``test_flash_attn_splitkv`` that its bound cannot pass by rounding:
``[1-339-True-32-False-False-True-True-dtype0]`` and ``[1-339-True-64-False-False-True-True-dtype1]``
(339 queries, one key, ALiBi, deterministic). With one key every probability is 1 and dV is the
sum of dO over the queries; torch's own result is that sum correctly rounded, so the test's bound
(8 times torch's error, plus 2e-4) is below one step of fp16/bf16 at dV's magnitude.

    python -m tuning.flash_attn_splitkv_ulps [cuda]

The same draws as the test (seed 0, in its order); prints dV's distance from the exact float64
sum in units in the last place, ours and the correctly rounded one."""
import sys

import torch

import rdnattention


def main(dev: str) -> None:
    for d, dtype in ((32, torch.float16), (64, torch.bfloat16)):
        torch.random.manual_seed(0)
        sq, sk, h = 339, 1, 12
        q = torch.randn(1, sq, h, d, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(1, sk, h, d, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(1, sk, h, d, device=dev, dtype=dtype, requires_grad=True)
        slopes = torch.rand(1, h, device=dev, dtype=torch.float32) * 0.3
        out = rdnattention.flash_attn_func(q, k, v, 0.0, causal=False, window_size=(-1, -1), alibi_slopes=slopes,
                                           deterministic=True)
        g = torch.randn_like(out)
        dv, = torch.autograd.grad(out, (v,), g)
        exact = g.double().sum(dim=1, keepdim=True)            # [1, 1, h, d]
        rounded = exact.to(dtype).double()                      # the correctly rounded value
        mant = 10 if dtype == torch.float16 else 7
        ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - mant)
        ours, best = ((dv.double() - exact).abs() / ulp).max().item(), ((rounded - exact).abs() / ulp).max().item()
        print(f"d={d} {dtype}: max |dV| {exact.abs().max().item():.3f}; ours vs exact float64: max {ours:.3f} ulp, "
              f"{int((dv.double() != rounded).sum())} of {dv.numel()} elements differ from the correctly rounded sum; "
              f"the correctly rounded sum vs exact: max {best:.3f} ulp; "
              f"max |ours - correctly rounded| {(dv.double() - rounded).abs().max().item():.6g}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")
