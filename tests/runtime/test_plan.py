"""The runtime's side of the family/platform design: the argument layout digest, dispatch tables
with constraints, plans, and the import boundary between runtime and generator."""

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT

import rdnattention_gen
from rdnattention import attention_reference, dispatch, flash_attn, plan_flash_attn
from rdnattention.abi import ArgStruct
from rdnattention.table import Constraints, KernelEntry, TargetTable
from rdnattention.errors import IncompatibleKernelsError, InvalidArgumentError, StaleKernelsError, UnsupportedError
from rdnattention.families import append, bwd, dec, f16, i8, i8dec, quant
from rdnattention.plan import Launch


def test_import_does_not_load_the_generator():
    code = ("import rdnattention, sys; "
            "print([m for m in sys.modules if m.startswith(('rdnattention_gen', 'jinja2', 'yaml', 'ninja'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.strip() == "[]"


def test_generator_and_its_data_come_from_this_checkout():
    assert rdnattention_gen.PACKAGE_DIR == REPO_ROOT / "rdnattention_gen"
    assert rdnattention_gen.DEFAULT_VARIANTS.is_file() and (rdnattention_gen.TEMPLATES / "include").is_dir()


def test_layout_digest_follows_the_fields():
    a = ArgStruct("S", (("x", "int"), ("y", "float")))
    assert a.digest == ArgStruct("S", (("x", "int"), ("y", "float"))).digest
    assert a.digest != ArgStruct("S", (("y", "float"), ("x", "int"))).digest
    assert a.digest != ArgStruct("S", (("x", "int"), ("y", "int"))).digest
    with pytest.raises(TypeError, match="C types without a ctypes mapping: double"):
        ArgStruct("S", (("x", "double"),))


def test_dispatch_table_records_format_and_digest(host_build):
    data = json.loads((host_build / "host" / "dispatch.json").read_text())
    assert data["format"] == dispatch.TABLE_FORMAT and data["dynamic_lds"] is False
    assert {e["args_digest"] for e in data["kernels"]} == {f16.ARGS.digest, i8.ARGS.digest, dec.ARGS.digest,
                                                           i8dec.ARGS.digest,
                                                           append.ARGS.digest, bwd.ARGS.digest, quant.ARGS.digest}
    assert all(e["provenance"] == "variants.yaml" for e in data["kernels"] if e["priority"] >= 0)
    # host's alternates: the tiles of the AMD tables it mirrors
    assert {e["provenance"] for e in data["kernels"] if e["priority"] < 0} == {"mirrors gfx1030", "mirrors gfx906"}


@pytest.fixture()
def host_copy(host_build, tmp_path):
    """A copy of the host build that a test may break."""
    shutil.copytree(host_build / "host", tmp_path / "host", ignore=shutil.ignore_patterns("*.o", "*.d"))
    return tmp_path / "host" / "dispatch.json"


def test_a_foreign_argument_layout_is_refused(host_copy, monkeypatch):
    data = json.loads(host_copy.read_text())
    first_f16 = next(i for i, e in enumerate(data["kernels"]) if e["family"] == "f16")
    data["kernels"][first_f16]["args_digest"] = "0123456789abcdef"
    host_copy.write_text(json.dumps(data))
    with pytest.raises(StaleKernelsError) as err:
        dispatch.load_table(host_copy)
    msg = str(err.value)
    assert "argument layout 0123456789abcdef" in msg and f"Fa2Args is {f16.ARGS.digest}" in msg
    assert msg.endswith("rebuild with: rdnattention-gen build --targets host")
    q = torch.randn(1, 2, 8, 64).half()
    # First on the search path, beside a usable table: skipped with a warning, never launched.
    monkeypatch.setenv("RDNATTENTION_BUILD_DIR", str(host_copy.parent.parent))
    dispatch.table_for.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="skipped kernels this runtime cannot use: .*argument layout "
                                                "0123456789abcdef.*; using "):
            assert dispatch.table_for("host").code_object != host_copy.parent / "librdnattention_host.so"
        # The only table: the call is refused.
        monkeypatch.setattr(dispatch, "search_path", lambda: [host_copy.parent.parent])
        dispatch.table_for.cache_clear()
        with pytest.raises(StaleKernelsError, match="argument layout 0123456789abcdef"):
            flash_attn(q, q, q)
    finally:
        dispatch.table_for.cache_clear()


@pytest.mark.parametrize("text, message", [
    ("{not json", "unreadable dispatch table (JSONDecodeError"),
    ('{"format": 3, "kernels": []}', "table format 3, this runtime reads format 6"),
    ('{"format": 6, "kernels": [{"family": "f16"}]}', "unreadable dispatch table (ValueError: kernels[0] has no head_dim, gqa_group"),
])
def test_a_malformed_table_is_a_typed_error(host_copy, text, message):
    host_copy.write_text(text)
    with pytest.raises(IncompatibleKernelsError, match=re.escape(message)):
        dispatch.load_table(host_copy)


@pytest.mark.parametrize("change, message", [
    (lambda e: e.update(layout="paged"), "kernels[{i}].layout 'paged' is not a layout of family f16 (it has len, "
                                         "varlen)"),
    (lambda e: e.update(layout="len"), "kernels[{i}].layout is 'len' but kernel {name} was built for None"),
    (lambda e: e.update(layout=7), "kernels[{i}].layout = 7 is not a string or null"),
])
def test_an_entry_whose_layout_its_kernel_lacks_is_refused(host_copy, change, message):
    """A plain kernel listed as compiled for a layout would read its arguments another way."""
    data = json.loads(host_copy.read_text())
    i = next(i for i, e in enumerate(data["kernels"]) if e["family"] == "f16" and e["layout"] is None)
    change(data["kernels"][i])
    host_copy.write_text(json.dumps(data))
    with pytest.raises(IncompatibleKernelsError, match=re.escape(message.format(i=i, name=data["kernels"][i]["name"]))):
        dispatch.load_table(host_copy)


def _entry(name, group=1, priority=0, when=Constraints()):
    return KernelEntry(name=name, family="f16", head_dim=64, gqa_group=group, tier="dot2", threads=256, br=128,
                       bc=64, tm=8, lds_bytes=1024, priority=priority, when=when, provenance="test", args_digest="x")


TABLE = TargetTable(target="t", platform="host", code_object=REPO_ROOT, dynamic_lds=False, kernels=(
    _entry("base1"), _entry("base2", group=2), _entry("causal1", priority=1, when=Constraints(causal=True)),
    _entry("short1", priority=1, when=Constraints(causal=False, seq_q=(0, 16))),
))


@pytest.mark.parametrize("heads_per_kv, causal, seq_q, chosen", [
    (1, False, 100, "base1"), (1, True, 100, "causal1"), (1, False, 8, "short1"), (1, False, 17, "base1"),
    (2, True, 100, "base2"), (4, False, 8, "base2"), (3, True, 5, "causal1"),
])
def test_select_honours_group_and_constraints(heads_per_kv, causal, seq_q, chosen):
    assert TABLE.select("f16", head_dim=64, heads_per_kv=heads_per_kv, causal=causal, seq_q=seq_q).name == chosen


def test_select_explains_what_it_cannot_serve():
    with pytest.raises(UnsupportedError, match=r"no f16 kernel for head_dim 96 on t; built head_dims: \[64\]"):
        TABLE.select("f16", head_dim=96, heads_per_kv=1, causal=False, seq_q=1)
    with pytest.raises(UnsupportedError, match="kernel 'causal1' does not serve this call on t; kernels that do: "
                                               "base1, short1"):
        TABLE.select("f16", head_dim=64, heads_per_kv=1, causal=False, seq_q=4, kernel="causal1")
    assert TABLE.select("f16", head_dim=64, heads_per_kv=2, causal=False, seq_q=4, kernel="base1").name == "base1"


def test_plan_is_one_launch_and_reruns(host_build):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 70, 64, generator=g).half() for _ in range(3))
    plan = plan_flash_attn(q[:, :, :, :], k[:, :2], v[:, :2], is_causal=True)
    [launch] = plan.launches
    assert launch.grid == (-(-70 // (launch.kernel.br // 2)), 2, 1) and launch.kernel.gqa_group == 2
    assert launch.args.heavy_first == 1 and launch.block == launch.kernel.threads and launch.shared_bytes == 0
    plan.run()
    first = plan.outputs[0].clone()
    plan.run()
    assert torch.equal(plan.outputs[0], first)
    ref = attention_reference(q, k[:, :2], v[:, :2], is_causal=True)
    assert (first.double() - ref).abs().max() <= 2e-3


def test_plan_options(host_build):
    q = torch.randn(1, 4, 40, 64).half()
    k = v = torch.randn(1, 2, 40, 64).half()
    assert plan_flash_attn(q, k, v).launches[0].args.heavy_first == 0
    assert plan_flash_attn(q, k, v, is_causal=True, heavy_first=False).launches[0].args.heavy_first == 0
    group1 = next(e.name for e in dispatch.table_for("host").kernels
                  if e.family == "f16" and e.head_dim == 64 and e.gqa_group == 1 and e.dtype is None
                  and e.score is None)
    plan = plan_flash_attn(q, k, v, is_causal=True, kernel=group1)
    assert plan.launches[0].kernel.name == group1 and plan.launches[0].grid[1] == 4
    plan.run()
    assert (plan.outputs[0].double() - attention_reference(q, k, v, is_causal=True)).abs().max() <= 2e-3
    with pytest.raises(InvalidArgumentError, match="heavy_first must be a bool or None, got 1"):
        plan_flash_attn(q, k, v, heavy_first=1)
    with pytest.raises(InvalidArgumentError, match="kernel must be a kernel name"):
        plan_flash_attn(q, k, v, kernel=3)


def _launch(grid, threads):
    return Launch(kernel=dataclasses.replace(_entry("k"), threads=threads), grid=grid, block=threads, shared_bytes=0,
                  args=f16.Fa2Args())


def test_a_grid_at_every_limit_is_accepted():
    assert _launch((2**31 - 1, 65535, 65535), 2).grid == (2**31 - 1, 65535, 65535)  # 2^32 - 2 work-items
    assert _launch((2**24 - 1, 1, 1), 256).block == 256


@pytest.mark.parametrize("grid, threads, limit", [
    # within CUDA's 2^31 - 1 workgroups in x, beyond HIP's 2^32 - 1 work-items
    ((2**24, 1, 1), 256, "grid.x * threads = 4294967296 must be at most 2^32 - 1 work-items (HIP)"),
    ((2**31, 1, 1), 1, "grid.x = 2147483648 must be at most 2^31 - 1 workgroups (CUDA)"),
    ((1, 65536, 1), 64, "grid.y = 65536 must be at most 65535 workgroups (CUDA)"),
    ((1, 1, 65536), 64, "grid.z = 65536 must be at most 65535 workgroups (CUDA)"),
])
def test_a_grid_beyond_a_vendor_limit_is_refused(grid, threads, limit):
    with pytest.raises(InvalidArgumentError) as err:
        _launch(grid, threads)
    assert str(err.value) == f"the launch grid {grid} of kernel k with {threads} threads exceeds the launch limits: {limit}"


def _meta(*shape):
    return torch.empty(shape, dtype=torch.float16, device="meta")


def test_the_planners_check_the_grid_before_allocating(host_build, monkeypatch):
    """Meta tensors: shapes whose launches exceed the limits, at no memory. The checks come before
    the split-KV scratch is allocated, so none is."""
    table = dispatch.table_for("host")
    # 2^31 - 1 keys, one slice per step: 2^25 or more workgroups in x of 128 threads, below 2^31
    one, keys = _meta(1, 1, 1, 64), _meta(1, 1, 2**31 - 1, 64)
    many_slices = dec.Call(q=one, k=keys, v=keys, out=one, lse=None, window=(-1, -1), softmax_scale=1.0, batch=1,
                           seq_q=1, seq_k=2**31 - 1, num_splits=2**31 - 1)
    batches = _meta(65536, 1, 64, 64)
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: pytest.fail("scratch allocated before the grid check"))
    with pytest.raises(InvalidArgumentError, match=r"kernel fa2_dec_\w+ with 128 threads exceeds the launch limits: "
                                                   r"grid.x \* threads = \d+ must be at most 2\^32 - 1 work-items"):
        dec.plan(table, many_slices)
    with pytest.raises(InvalidArgumentError, match=r"kernel fa2_f16_\w+ with 256 threads exceeds the launch limits: "
                                                   r"grid.z = 65536 must be at most 65535"):
        f16.plan(table, f16.Call(q=batches, k=batches, v=batches, out=batches, lse=None, window=(-1, -1),
                                 softmax_scale=1.0, batch=65536, seq_q=64, seq_k=64))
