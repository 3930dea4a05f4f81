"""Hostile and unlucky inputs (issue: hardening): each is a typed error or a correct result, never a
signal. Cases that crashed the process before run in a subprocess, so a regression fails the test
instead of killing the run."""

import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO_ROOT

from rdnattention import attention_reference, flash_attn
from rdnattention.errors import InvalidArgumentError


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO_ROOT, env={**os.environ, **(env or {})}, timeout=300)


@pytest.mark.parametrize("break_k, message", [
    ("k.untyped_storage().resize_(0)", "k has no memory behind it (null data pointer"),
    ("k.untyped_storage().resize_(1024)", "k's shape (1, 2, 16, 64) and strides (2048, 1024, 64, 1) reach 4096 bytes "
                                          "but its storage holds 1024"),
    ("k = torch._neg_view(k)", "k is a lazily negated or conjugated view"),
])
def test_tensors_without_readable_memory_are_refused(host_build, break_k, message):
    out = _run(f"""
        import torch
        from rdnattention import flash_attn
        from rdnattention.errors import InvalidArgumentError
        q = torch.randn(1, 2, 16, 64).half()
        k = torch.randn(1, 2, 16, 64).half()
        flash_attn(q, k, k)  # a first call plans (and remembers) this geometry
        {break_k}
        try:
            flash_attn(q, k, k)
        except InvalidArgumentError as e:
            print("InvalidArgumentError:", e)
        """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"InvalidArgumentError: {message}" in out.stdout


def test_windows_beyond_the_sequences_mean_unbounded(host_build):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 30, 64, generator=g).half(), torch.randn(1, 2, 40, 64, generator=g).half()
    for window in ((2**31, 2**31 - 1), (2**40, -1), (-1, 2**32)):
        assert torch.equal(flash_attn(q, k, k, window_size=window), flash_attn(q, k, k))
    assert torch.equal(flash_attn(q, k, k, is_causal=True, window_size=(2**31 - 1, -1)),
                       flash_attn(q, k, k, is_causal=True))


def test_scale_beyond_float32_is_refused(host_build):
    q = torch.randn(1, 2, 8, 64).half()
    with pytest.raises(InvalidArgumentError, match="times log2\\(e\\) is beyond float32's range"):
        flash_attn(q, q, q, softmax_scale=3e38)


def test_jit_trace_records_the_op(host_build):
    q, k, v = (torch.randn(1, 2, 20, 64).half() for _ in range(3))
    traced = torch.jit.trace(lambda q, k, v: flash_attn(q, k, v, is_causal=True), (q, k, v), check_trace=False)
    assert "rdnattention::flash_attn_fwd" in str(traced.graph)
    q2 = torch.randn(1, 2, 20, 64).half()
    ref = attention_reference(q2, k, v, is_causal=True)
    assert (traced(q2, k, v).double() - ref).abs().max() <= 2e-3


def test_a_bad_shuffle_variable_does_not_break_import(host_build):
    out = _run("""
        import torch, rdnattention
        from rdnattention.errors import InvalidArgumentError
        q = torch.randn(1, 2, 8, 64).half()
        try:
            rdnattention.flash_attn(q, q, q)
        except InvalidArgumentError as e:
            print("InvalidArgumentError:", e)
        """, env={"RDNATTENTION_HOST_SHUFFLE": "abc"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "InvalidArgumentError: RDNATTENTION_HOST_SHUFFLE='abc' must be a non-negative integer seed" in out.stdout


def test_emulator_out_of_memory_is_a_launch_error(host_build):
    out = _run("""
        import resource, torch
        from rdnattention import flash_attn
        from rdnattention.errors import LaunchError
        q = torch.randn(1, 2, 64, 64).half()
        flash_attn(q, q, q)
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))
        try:
            flash_attn(q, q, q)
            print("no error")
        except LaunchError as e:
            print("LaunchError:", e)
        """, env={"RDNATTENTION_HOST_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LaunchError:" in out.stdout and "std::bad_alloc" in out.stdout


def test_generated_files_follow_the_umask(matrix, tmp_path):
    from rdnattention_gen.render import generate
    old = os.umask(0o022)
    try:
        generate(matrix, [matrix.target("host")], tmp_path)
    finally:
        os.umask(old)
    modes = {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "host").iterdir()}
    assert modes == {0o644}


def test_target_names_match_in_full(tmp_path):
    from test_matrix import MINIMAL, _load

    from rdnattention_gen.strict_yaml import VariantsError
    with pytest.raises(VariantsError, match="target names are gfxNNN"):
        _load(tmp_path, MINIMAL.replace("  gfx1030:\n", '  "gfx1030\\n":\n', 1))
