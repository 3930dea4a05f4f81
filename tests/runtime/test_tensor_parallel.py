"""transformers' tensor parallelism (``tp_plan="auto"`` over torch.distributed) with
``attn_implementation="rdnattention"``: two processes each run the kernels on their half of the
heads, and the logits equal one process's: gloo with CPU tensors on the host emulator, and NCCL on
two GPUs where there are two (marked gpu)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' tp_plan needs accelerate (in the test extra)")

from conftest import REPO_ROOT  # noqa: E402

pytestmark = pytest.mark.slow

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist, transformers
    from transformers import AttentionInterface
    import rdnattention.integrations.transformers as rt

    model_dir, out, device = sys.argv[1], sys.argv[2], sys.argv[3]
    rt.register()
    served = []
    def counting(module, query, *args, **kwargs):
        served.append(tuple(query.shape))
        return rt.attention_forward(module, query, *args, **kwargs)
    AttentionInterface.register(rt.NAME, counting)
    tp = len(sys.argv) > 4
    if tp:
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() if tp else 0)
    kw = {"tp_plan": "auto"} if tp else ({"device_map": "cuda:0"} if device == "cuda" else {})
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16,
                                                              attn_implementation=rt.NAME, **kw).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4], [8, 6, 2, 9, 1, 3, 5, 7]], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits.float().cpu()
    rank = dist.get_rank() if tp else 0
    torch.save(logits, f"{out}.{rank}.pt")
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"served": served, "fallbacks": rt.counts()["fallbacks"]}, f)
    if tp:
        dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _two_ranks(tmp_path, device: str) -> None:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).half().save_pretrained(tmp_path / "model")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    _run([sys.executable, str(script), str(tmp_path / "model"), str(tmp_path / "one"), device], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
          str(script), str(tmp_path / "model"), str(tmp_path / "tp"), device, "tp"], tmp_path)

    one = torch.load(tmp_path / "one.0.pt")
    one_calls = json.loads((tmp_path / "one.0.json").read_text())
    assert one_calls["fallbacks"] == {} and len(one_calls["served"]) == 2  # one call per layer
    for rank in (0, 1):
        calls = json.loads((tmp_path / f"tp.{rank}.json").read_text())
        # Each rank's attention holds half of the 4 query heads (and of the 2 K/V heads) and runs
        # on the kernels, one call per layer.
        assert calls["fallbacks"] == {}
        assert [tuple(s) for s in calls["served"]] == [(2, 2, 8, 64)] * 2
        tp = torch.load(tmp_path / f"tp.{rank}.pt")
        # The same kernels on the same rows; the projections' partial sums are reduced across ranks
        # in another order, so the logits agree to fp16 rounding, not bit for bit.
        torch.testing.assert_close(tp, one, atol=2e-2, rtol=2e-2)


def test_two_ranks_of_tp_plan_auto_run_the_kernels_and_equal_one_process(host_build, tmp_path):
    _two_ranks(tmp_path, "cpu")


@pytest.mark.gpu
def test_two_gpus_of_tp_plan_auto_over_nccl_run_the_kernels_and_equal_one_gpu(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    _two_ranks(tmp_path, "cuda")
