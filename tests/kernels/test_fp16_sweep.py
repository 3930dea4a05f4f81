"""The GPU targets' tiles of the fp16 family (every layout), mirrored as the host targets' alternates, against the
float64 oracle by name. (Every family's cases on every host head_dim: tests/kernels/test_oracle_sweep.py.)"""

import pytest
import torch
from cases import TOLS, make_case, mirrored_kernels

from rdnattention import attention_reference


# The AMD tables' tiles (and sm_90's tuned ones) run here as the host's alternates: every case of the
# sweep through each of them, by name. Layout len runs with cache lengths, varlen on a packed batch.
# (The int8 ones: tests/kernels/test_int8.py.)
@pytest.mark.parametrize("target,name", mirrored_kernels(("f16",)))
def test_mirrored_gpu_tiles_match_oracle(host_build, monkeypatch, target, name):
    from rdnattention import plan_flash_attn
    from rdnattention.route import device_table
    from rdnattention.families import f16
    from rdnattention_gen.families import spec_from_name

    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    spec = spec_from_name(name)
    layout = spec.option("layout")
    dtype = spec.option("dtype") or "fp16"  # a bf16 kernel's tile runs on bf16 inputs
    cases = ["plain", "causal", "window_two_sided", "gqa"] if layout is None else ["causal", "gqa"]
    score = spec.option("score")
    for variant in cases:
        q, k, v, options = make_case(variant, spec.head_dim, dtype=dtype)
        if (q.shape[1] // k.shape[1]) % spec.gqa_group:
            continue
        # A score option's kernels serve only calls with its transforms: ALiBi slopes per head; a
        # softcap and sinks per head.
        g = torch.Generator().manual_seed(spec.head_dim)
        if score == "alibi":
            options["alibi_slopes"] = torch.rand(q.shape[1], generator=g)
        elif score == "xf":
            options.update(softcap=4.0, sinks=torch.randn(q.shape[1], generator=g))
        if layout == "varlen":  # the batch packed into one sequence pair: cu_seqlens [0, n]
            cu_q = torch.tensor([0, q.shape[2]], dtype=torch.int32)
            cu_k = torch.tensor([0, k.shape[2]], dtype=torch.int32)
            out = torch.zeros_like(q)
            call = f16.Call(q=q, k=k, v=v, out=out, lse=None, window=(-1, 0) if options.get("is_causal") else (-1, -1),
                            softmax_scale=q.shape[-1] ** -0.5, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            batch=1, seq_q=q.shape[2], seq_k=k.shape[2], kernel=name,
                            softcap=options.get("softcap", 0.0), alibi_slopes=options.get("alibi_slopes"),
                            sinks=options.get("sinks"))
            plan = f16.plan(device_table(q.device), call)
            ref = attention_reference(q, k, v, **options)
        else:
            seqused = torch.full((q.shape[0],), k.shape[2] - 7, dtype=torch.int32) if layout == "len" else None
            plan = plan_flash_attn(q, k, v, kernel=name, seqused_k=seqused, **options)
            ref = attention_reference(q, k[:, :, :k.shape[2] - 7] if seqused is not None else k,
                                      v[:, :, :k.shape[2] - 7] if seqused is not None else v, **options)
        assert plan.launches[-1].kernel.name == name
        plan.run()
        err = (plan.outputs[0].double() - ref).abs().max().item()
        assert err <= TOLS[dtype][0], f"{variant}: max abs error {err:.2e}"
