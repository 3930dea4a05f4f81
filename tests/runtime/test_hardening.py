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
from rdnattention.families import f16


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
        from rdnattention import plan_flash_attn
        from rdnattention.drivers import host
        from rdnattention.errors import LaunchError
        q = torch.randn(1, 2, 64, 64).half()
        plan = plan_flash_attn(q, q, q)
        host._library(plan.table.code_object)
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize")) * 1024
        # Room for the threads' stacks, not for the emulator's fiber stacks (64 MiB per worker).
        resource.setrlimit(resource.RLIMIT_AS, (vm + (24 << 20), resource.RLIM_INFINITY))
        try:
            plan.run()
            print("no error")
        except LaunchError as e:
            print("LaunchError:", e)
        """, env={"RDNATTENTION_HOST_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LaunchError:" in out.stdout and "std::bad_alloc" in out.stdout


def test_a_normal_call_fits_a_modest_address_space(host_build):
    # Eight workers, each with 256 fiber stacks and the LDS, in 320 MiB of address space beyond what
    # the process has mapped (256 KiB stacks without guard pages needed over 512 MiB).
    out = _run("""
        import resource, torch
        from rdnattention import plan_flash_attn, attention_reference
        from rdnattention.drivers import host
        q = torch.randn(1, 8, 512, 128).half()
        plan = plan_flash_attn(q, q, q, is_causal=True)
        host._library(plan.table.code_object)
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (320 << 20), resource.RLIM_INFINITY))
        plan.run()
        ref = attention_reference(q, q, q, is_causal=True)
        print("max error", (plan.outputs[0].double() - ref).abs().max().item())
        """, env={"RDNATTENTION_HOST_THREADS": "8"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) <= 2e-3


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


# --- build state: tables and libraries -------------------------------------------------------------

@pytest.fixture()
def host_copy(host_build, tmp_path, monkeypatch):
    """A copy of the host build, the only one the runtime sees; a test may break it."""
    import shutil

    from rdnattention import dispatch
    shutil.copytree(host_build / "host", tmp_path / "host", ignore=shutil.ignore_patterns("*.o", "*.d"))
    monkeypatch.setattr(dispatch, "search_path", lambda: [tmp_path])
    dispatch.table_for.cache_clear()
    yield tmp_path / "host"
    dispatch.table_for.cache_clear()


def _edit_table(table_dir, edit):
    import json
    path = table_dir / "dispatch.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("field, value, message", [
    ("head_dim", 128, "kernels[0].head_dim is 128 but kernel fa2_f16_hd32_g1_br128_bc64_nt256_tm8_w32_cvt_fma_sf16 "
                      "was built for 32"),
    ("br", 64, "kernels[0].br is 64 but kernel"),
    ("gqa_group", 2, "kernels[0].gqa_group is 2 but kernel"),
    ("threads", 128, "kernels[0].threads is 128 but kernel"),
    ("tier", "dot2", "kernels[0].tier is 'dot2' but kernel"),
    ("name", "fa2_f16_hd32_bogus", "kernels[0].name 'fa2_f16_hd32_bogus' is not a f16 kernel name"),
    ("br", "128", "kernels[0].br = '128' is not a non-negative integer"),
    ("gqa_group", 0, "impossible tile: group 0"),
    ("lds_bytes", 1024, "kernels[0].lds_bytes is 1024 but kernel fa2_f16_hd32_g1_br128_bc64_nt256_tm8_w32_cvt_fma_sf16 "
                        f"uses {f16.lds_bytes(f16.NAMES.parse('fa2_f16_hd32_g1_br128_bc64_nt256_tm8_w32_cvt_fma_sf16'))}"),
])
def test_a_table_that_disagrees_with_its_kernel_names_is_refused(host_copy, field, value, message):
    from rdnattention import dispatch
    from rdnattention.errors import IncompatibleKernelsError

    def edit(data):
        # kernels[0]: f16 head_dim 32, group 1
        data["kernels"].sort(key=lambda e: (e["family"] != "f16" or e["head_dim"] != 32, e["gqa_group"]))
        data["kernels"][0][field] = value
    _edit_table(host_copy, edit)
    with pytest.raises(IncompatibleKernelsError) as err:
        dispatch.load_table(host_copy / "dispatch.json")
    assert message in str(err.value) and str(host_copy / "dispatch.json") in str(err.value)


def test_a_table_with_another_wave_size_is_refused(host_copy):
    from rdnattention import dispatch
    from rdnattention.errors import IncompatibleKernelsError
    _edit_table(host_copy, lambda d: d.update(wave_size=64))
    with pytest.raises(IncompatibleKernelsError, match="wave_size is 64 but kernel .* was built for 32"):
        dispatch.load_table(host_copy / "dispatch.json")


@pytest.mark.parametrize("code_object", ["../host_f32/librdnattention_host.so", "/etc/passwd", ""])
def test_a_code_object_outside_the_table_directory_is_refused(host_copy, code_object):
    from rdnattention import dispatch
    from rdnattention.errors import IncompatibleKernelsError
    _edit_table(host_copy, lambda d: d.update(code_object=code_object))
    with pytest.raises(IncompatibleKernelsError, match="is not a file name beside the table"):
        dispatch.load_table(host_copy / "dispatch.json")


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"bytes, its dispatch table records \d+ \(truncated or replaced\)"),
    ("empty", r"0 bytes, its dispatch table records"),
    ("flip", "SHA-256 differs from the one its dispatch table records"),
])
def test_a_damaged_code_object_is_refused_before_loading(host_copy, damage, message):
    # A truncated shared library used to kill the process with SIGBUS when loaded: run in a subprocess.
    lib = host_copy / "librdnattention_host.so"
    data = lib.read_bytes()
    lib.write_bytes({"truncate": data[:len(data) // 2], "empty": b"",
                     "flip": data[:-100] + bytes([data[-100] ^ 1]) + data[-99:]}[damage])
    out = _run("""
        import torch
        from rdnattention import flash_attn
        from rdnattention.errors import IncompatibleKernelsError
        q = torch.randn(1, 2, 8, 64).half()
        try:
            flash_attn(q, q, q)
        except IncompatibleKernelsError as e:
            print("IncompatibleKernelsError:", e)
        """, env={"RDNATTENTION_BUILD_DIR": str(host_copy.parent)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "IncompatibleKernelsError: " + str(lib) in out.stdout
    import re
    assert re.search(message, out.stdout) and "rdnattention-gen build --targets host" in out.stdout


@pytest.mark.parametrize("content, message", [
    (b"", "not a loadable host kernel library"),
    (b"not an ELF file at all", "not a loadable host kernel library"),
    (None, "lacks rdna_host_abi_version, rdna_host_launch: not an rdnattention host kernel"),
])
def test_an_empty_or_foreign_host_library_is_a_typed_error(tmp_path, content, message):
    import ctypes.util

    from rdnattention.drivers import host
    from rdnattention.errors import IncompatibleKernelsError
    lib = tmp_path / "host" / "librdnattention_host.so"
    lib.parent.mkdir()
    if content is None:  # a real shared library, not ours
        import shutil
        shutil.copy(next(p for p in ("/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1",
                                     ctypes.util.find_library("z") or "") if p and os.path.isfile(p)), lib)
    else:
        lib.write_bytes(content)
    with pytest.raises(IncompatibleKernelsError) as err:
        host._library(lib)
    assert str(lib) in str(err.value) and message in str(err.value)
    assert str(err.value).endswith("rebuild with: rdnattention-gen build --targets host")


@pytest.mark.parametrize("env, value, message", [
    ("RDNATTENTION_HOST_TARGET", "gfx1030", "RDNATTENTION_HOST_TARGET=gfx1030 names a target of platform amdgcn, "
                                            "but tensors on cpu run on host targets"),
    ("RDNATTENTION_HOST_TARGET", "gfx906", "RDNATTENTION_HOST_TARGET=gfx906 names a target of platform amdgcn"),
])
def test_a_gpu_target_forced_on_cpu_tensors_is_refused(default_audit, host_build, monkeypatch, env, value, message):
    from rdnattention import dispatch
    from rdnattention.errors import UnsupportedError
    if not (host_build / value / "dispatch.json").is_file():
        pytest.skip(f"{value} is not built on this machine")
    monkeypatch.setenv(env, value)
    q = torch.randn(1, 2, 8, 64).half()
    with pytest.raises(UnsupportedError, match=message):
        flash_attn(q, q, q)
    dispatch.table_for.cache_clear()


# --- NaN ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["host", "host_f32"])
def test_a_nan_score_makes_its_row_nan_and_only_rows_that_see_it(host_build, monkeypatch, target):
    from rdnattention import dispatch
    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", target)
    dispatch.table_for.cache_clear()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g).half() for _ in range(3))
    k[0, 0, 25, 7] = float("nan")   # head 0: rows 25.. see key 25 under the causal mask
    q[0, 1, 10, 3] = float("nan")   # head 1: row 10 only
    out, lse = flash_attn(q, k, v, is_causal=True, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, is_causal=True, return_lse=True)
    nan_rows = torch.zeros(2, 40, dtype=torch.bool)
    nan_rows[0, 25:] = True
    nan_rows[1, 10] = True
    assert torch.equal(ref_lse[0].isnan(), nan_rows) and torch.equal(ref[0].isnan().all(-1), nan_rows)
    assert torch.equal(lse[0].isnan(), nan_rows) and torch.equal(out[0].isnan().all(-1), nan_rows)
    assert not out[0][~nan_rows].isnan().any()
    assert (out[0][~nan_rows].double() - ref[0][~nan_rows]).abs().max() <= 2e-3
    dispatch.table_for.cache_clear()


# --- Ctrl-C --------------------------------------------------------------------------------------------

def test_ctrl_c_interrupts_a_long_emulator_call(host_build):
    import signal
    import time
    code = textwrap.dedent("""
        import sys, time, torch
        from rdnattention import flash_attn
        q = torch.randn(1, 8, 4096, 128).half()
        flash_attn(q[:, :, :64], q[:, :, :64], q[:, :, :64])  # loads the library
        print("started", flush=True)
        t = time.monotonic()
        try:
            flash_attn(q, q, q)
            print("finished", flush=True)
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - t:.1f}s", flush=True)
        flash_attn(q[:, :, :64], q[:, :, :64], q[:, :, :64])  # the library still works
        print("ok", flush=True)
        """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, env={**os.environ, "RDNATTENTION_HOST_THREADS": "1"})
    assert proc.stdout.readline().strip() == "started"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    lines = out.split()
    assert lines[0] == "interrupted" and float(lines[2].rstrip("s")) < 10 and lines[-1] == "ok", out
