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

import rdnattention
from rdnattention import attention_reference, flash_attn, flash_attn_with_kvcache
from rdnattention.errors import InvalidArgumentError, UnsupportedError
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
    ("RDNATTENTION_HOST_TARGET", "sm_86", "RDNATTENTION_HOST_TARGET=sm_86 names a target of platform cuda"),
])
def test_a_gpu_target_forced_on_cpu_tensors_is_refused(host_build, monkeypatch, env, value, message):
    """Refused by the target's name, whether or not its kernels are built (sm_86 never is)."""
    from rdnattention import dispatch
    from rdnattention.errors import UnsupportedError
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
        import signal, sys, time, torch
        # Ctrl-C raises KeyboardInterrupt here even where the test runner ignores SIGINT (an ignored
        # signal is inherited by child processes).
        signal.signal(signal.SIGINT, signal.default_int_handler)
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


# --- flash_attn_with_kvcache: a refused call writes nothing (issue: hardening, second round) ---------

def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of t's storage (beyond its view too)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def _cache_call():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 64, generator=g).half()
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, generator=g).half() for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 64, generator=g).half() for _ in range(2))
    return q, k_cache, v_cache, dict(k=k, v=v, cache_seqlens=torch.tensor([10, 20], dtype=torch.int32))


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(t.numel() + 8, dtype=t.dtype)
    shifted = buf[4:4 + t.numel()].view(t.shape)  # same shape and strides, pointer 8 bytes off
    return shifted.copy_(t)


def _big_batch(q, k_cache, v_cache, kw):
    n = 65536  # grid.z = batch: one past CUDA's limit
    kw.update(cache_batch_idx=torch.zeros(n, dtype=torch.int32), cache_seqlens=torch.zeros(n, dtype=torch.int32),
              k=torch.zeros(n, 1, 2, 64, dtype=torch.float16), v=torch.zeros(n, 1, 2, 64, dtype=torch.float16))
    return torch.zeros(n, 1, 2, 64, dtype=torch.float16), k_cache, v_cache


def _paged_pool(q, k_cache, v_cache, kw):
    kw["block_table"] = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    return q, *(torch.randn(8, 16, 2, 64).half() for _ in range(2))


def _page_past_the_pool(q, k_cache, v_cache, kw):
    q, k_cache, v_cache = _paged_pool(q, k_cache, v_cache, kw)
    kw["block_table"][1, 3] = 8
    return q, k_cache, v_cache


def _head_dim_32(q, k_cache, v_cache, kw):
    kw.update(k=kw["k"][..., :32].contiguous(), v=kw["v"][..., :32].contiguous())
    return q[..., :32].contiguous(), k_cache[..., :32].contiguous(), v_cache[..., :32].contiguous()


def _tables(kw, positions=64):
    cos, sin = rdnattention.rotary_tables(positions, 32)
    kw.update(rotary_cos=cos, rotary_sin=sin)


@pytest.mark.parametrize("change, error, message", [
    (lambda q, kc, vc, kw: kw.update(window_size=(-2, 0)), InvalidArgumentError, "window_size values must be >= -1"),
    (lambda q, kc, vc, kw: kw.update(causal=1), InvalidArgumentError, "causal must be a bool, got 1"),
    (lambda q, kc, vc, kw: kw.update(softmax_scale=float("nan")), InvalidArgumentError,
     "softmax_scale must be a finite number"),
    (lambda q, kc, vc, kw: kw.update(softmax_scale=3e38), InvalidArgumentError, "times log2(e) is beyond float32"),
    (lambda q, kc, vc, kw: (q[:, :, :3].contiguous(), kc, vc), InvalidArgumentError,
     "q heads (3) must be a multiple of k/v heads (2)"),
    (lambda q, kc, vc, kw: (q, kc, _misaligned(vc)), InvalidArgumentError, "v_cache rows must start on 16-byte"),
    (lambda q, kc, vc, kw: kw["k"].requires_grad_(True), UnsupportedError, "k requires grad"),
    (lambda q, kc, vc, kw: (q.requires_grad_(True), kc, vc), UnsupportedError, "requires grad"),
    (_head_dim_32, UnsupportedError, "no dec kernel for head_dim 32"),
    (lambda q, kc, vc, kw: kw.update(num_splits=2) or _head_dim_32(q, kc, vc, kw), UnsupportedError,
     "no dec kernel for head_dim 32"),
    (_big_batch, InvalidArgumentError, "grid.z = 65536 must be at most 65535 workgroups"),
    # int32 arithmetic wrapped cache_seqlens + seq_new to a negative number here
    (lambda q, kc, vc, kw: kw.update(cache_seqlens=torch.tensor([2**31 - 1, 0], dtype=torch.int32)),
     InvalidArgumentError, "cache_seqlens + seq_new (1) must lie in [0, cache_len = 64], got cache_seqlens "
                           "[2147483647, 0]"),
    (lambda q, kc, vc, kw: kw.update(cache_seqlens=-1), InvalidArgumentError,
     "cache_seqlens + seq_new (1) must lie in [0, cache_len = 64], got cache_seqlens -1"),
    (lambda q, kc, vc, kw: kw.update(cache_seqlens=torch.tensor([10, -1], dtype=torch.int32)),
     InvalidArgumentError, "cache_seqlens + seq_new (1) must lie in [0, cache_len = 64]"),
    (lambda q, kc, vc, kw: kw.update(k=torch.empty(2, 1, 2, 64, dtype=torch.float16, device="meta")),
     InvalidArgumentError, "k is on meta, the cache on cpu"),
    (lambda q, kc, vc, kw: kw.update(v=torch.empty(2, 1, 2, 64, dtype=torch.float16, device="meta")),
     InvalidArgumentError, "v is on meta, the cache on cpu"),
    (lambda q, kc, vc, kw: _tables(kw, positions=20), InvalidArgumentError,
     "rotary tables have 20 positions; the new keys and queries need cache_seqlens + 1 of them, got cache_seqlens "
     "[10, 20]"),
    (lambda q, kc, vc, kw: kw.update(cache_batch_idx=torch.tensor([1, 2], dtype=torch.int32)), InvalidArgumentError,
     "cache_batch_idx values must lie in [0, 1], got [1, 2]"),
    (_page_past_the_pool, InvalidArgumentError,
     "block_table values must lie in [0, 7], got [[0, 1, 2, 3], [4, 5, 6, 8]]"),
])
def test_a_refused_kvcache_call_leaves_every_tensor_as_it_was(host_build, change, error, message):
    q, k_cache, v_cache, kw = _cache_call()
    kw.setdefault("block_table", None)
    changed = change(q, k_cache, v_cache, kw)
    if isinstance(changed, tuple):
        q, k_cache, v_cache = changed
    given = {"q": q, "k_cache": k_cache, "v_cache": v_cache,
             **{n: t for n, t in kw.items() if isinstance(t, torch.Tensor) and t.device.type == "cpu"}}
    before = {n: _storage_bytes(t) for n, t in given.items()}
    with pytest.raises(error) as err:
        flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert message in str(err.value)
    assert [n for n, t in given.items() if not torch.equal(_storage_bytes(t), before[n])] == []
    assert k_cache.is_leaf and not k_cache.requires_grad and v_cache.is_leaf and not v_cache.requires_grad
    with torch.no_grad():  # the caches still serve calls
        q, k_cache, v_cache, kw = _cache_call()
        flash_attn_with_kvcache(q, k_cache, v_cache, **kw)


# Each case in its own process (they crashed it: a segfault in the kernel, or memory written past an
# output and glibc's abort at exit): defines `given` (the tensors whose bytes must not change) and
# `call`, which must raise the error named.
_HOSTILE = """
import torch
import rdnattention
from rdnattention import flash_attn_with_kvcache, varlen_attn
from rdnattention.errors import RdnaAttentionError
g = torch.Generator().manual_seed(0)
q = torch.randn(2, 1, 4, 64, generator=g).half()
k_cache, v_cache = (torch.randn(2, 64, 2, 64, generator=g).half() for _ in range(2))
k, v = (torch.randn(2, 1, 2, 64, generator=g).half() for _ in range(2))
kw = dict(k=k, v=v, cache_seqlens=torch.tensor([10, 20], dtype=torch.int32))
pool_k, pool_v = (torch.randn(8, 16, 2, 64, generator=g).half() for _ in range(2))
table = torch.tensor([[3, 1, 4, 0], [7, 6, 5, 2]], dtype=torch.int32)
packed_q = torch.randn(5, 4, 64, generator=g).half()
packed_k, packed_v = (torch.randn(70, 2, 64, generator=g).half() for _ in range(2))
cu_q, cu_k = torch.tensor([0, 1, 5], dtype=torch.int32), torch.tensor([0, 30, 70], dtype=torch.int32)

def call():
    flash_attn_with_kvcache(q, k_cache, v_cache, **kw)

def compiled(fn, backend="eager"):
    return torch.compile(fn, fullgraph=True, backend=backend)

{setup}
given = {{"q": q, "k_cache": k_cache, "v_cache": v_cache, **kw}} if "given" not in globals() else given
given = {{n: t for n, t in given.items() if isinstance(t, torch.Tensor)}}

def snapshot(t):
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()

before = {{n: snapshot(t) for n, t in given.items()}}
try:
    call()
    print("no error")
except RdnaAttentionError as e:
    print(f"{{type(e).__name__}}: {{e}}")
print("changed:", [n for n, t in given.items() if not torch.equal(snapshot(t), before[n])])
"""

_PAGED = "k_cache, v_cache = pool_k, pool_v; kw['block_table'] = table\n"
_COMPILED_PAGED = """
step = compiled(lambda q, pk, pv, table, lengths: flash_attn_with_kvcache(q, pk, pv, cache_seqlens=lengths,
                                                                          block_table=table){backend})
step(q, pool_k, pool_v, table, kw["cache_seqlens"])  # compiled with valid pages
{change}
given = dict(q=q, pool_k=pool_k, pool_v=pool_v, table=table)
call = lambda: step(q, pool_k, pool_v, table, kw["cache_seqlens"])
"""
_COMPILED_APPEND = """
step = compiled(lambda q, kc, vc, k, v, lengths, idx, table: flash_attn_with_kvcache(
    q, kc, vc, k, v, cache_seqlens=lengths, cache_batch_idx=idx, block_table=table){backend})
idx = None if {paged} else torch.tensor([1, 0], dtype=torch.int32)
kc, vc, tab = (pool_k, pool_v, table) if {paged} else (k_cache, v_cache, None)
step(q, kc, vc, k, v, kw["cache_seqlens"], idx, tab)  # compiled with valid indices
{change}
given = dict(q=q, kc=kc, vc=vc, k=k, v=v, idx=idx, tab=tab, lengths=kw["cache_seqlens"])
call = lambda: step(q, kc, vc, k, v, kw["cache_seqlens"], idx, tab)
"""
_COMPILED_PACKED = """
step = compiled(lambda q, k, v, cu_q, cu_k: varlen_attn(q, k, v, cu_q, cu_k, 4, 40, enable_gqa=True))
step(packed_q, packed_k, packed_v, cu_q, cu_k)
{change}
given = dict(q=packed_q, k=packed_k, v=packed_v, cu_q=cu_q, cu_k=cu_k)
call = lambda: step(packed_q, packed_k, packed_v, cu_q, cu_k)
"""


@pytest.mark.parametrize("setup, message", [
    # caches and pools by their own strides (they were checked through a stand-in view)
    (_PAGED + "k_cache, v_cache = (torch.randn(8, 16, 2, 128).half()[..., ::2] for _ in range(2))",
     "InvalidArgumentError: k_cache must be contiguous in its last dimension, got strides (4096, 256, 128, 2)"),
    (_PAGED + "k_cache, v_cache = (torch.randn(8, 16, 2, 68).half()[..., :64] for _ in range(2))",
     "InvalidArgumentError: k_cache rows must start on 16-byte boundaries: strides (2176, 136, 68)"),
    ("k_cache = torch.randn(3, 64, 2, 128).half()[..., ::2]; v_cache = k_cache.clone()\n"
     "kw['cache_batch_idx'] = torch.tensor([2, 0], dtype=torch.int32)",
     "InvalidArgumentError: k_cache must be contiguous in its last dimension"),
    ("v_cache = torch.randn(3, 64, 2, 68).half()[..., :64]; k_cache = torch.randn(3, 64, 2, 64).half()\n"
     "kw['cache_batch_idx'] = torch.tensor([2, 0], dtype=torch.int32)",
     "InvalidArgumentError: v_cache rows must start on 16-byte boundaries"),
    # storage shorter than the view
    ("kw['cache_seqlens'].untyped_storage().resize_(4)",
     "InvalidArgumentError: cache_seqlens's shape (2,) and strides (1,) reach 8 bytes but its storage holds 4"),
    ("k.untyped_storage().resize_(100)", "InvalidArgumentError: k's shape (2, 1, 2, 64)"),
    ("v.untyped_storage().resize_(0)", "InvalidArgumentError: v has no memory behind it"),
    ("cos, sin = rdnattention.rotary_tables(64, 32); kw.update(rotary_cos=cos, rotary_sin=sin)\n"
     "sin.untyped_storage().resize_(64)", "InvalidArgumentError: rotary_sin's shape (64, 16)"),
    ("k_cache.untyped_storage().resize_(1000)", "InvalidArgumentError: k_cache's shape (2, 64, 2, 64) and strides "
                                                "(8192, 128, 64, 1) reach 32768 bytes but its storage holds 1000"),
    (_PAGED + "table.untyped_storage().resize_(8)", "InvalidArgumentError: block_table's shape (2, 4)"),
    # compiled calls: the custom ops check the values they are given
    (_COMPILED_PAGED.format(backend="", change="table[1, 1] = 10**9"),
     "InvalidArgumentError: block_table values must lie in [0, 7]"),
    (_COMPILED_APPEND.format(backend="", paged=True, change="tab[1, 1] = -10**9"),
     "InvalidArgumentError: block_table values must lie in [0, 7]"),
    (_COMPILED_APPEND.format(backend=", backend='aot_eager'", paged=False, change="idx[0] = 10**9"),
     "InvalidArgumentError: cache_batch_idx values must lie in [0, 1], got [1000000000, 0]"),
    (_COMPILED_APPEND.format(backend="", paged=False, change="kw['cache_seqlens'][1] = 64"),
     "InvalidArgumentError: cache_seqlens + seq_new (1) must lie in [0, cache_len = 64]"),
    (_COMPILED_PACKED.format(change="cu_k[2] = 700"), "InvalidArgumentError: cu_seqlens_k ends at 700, past the 70 "
                                                      "packed rows"),
    (_COMPILED_PACKED.format(change="cu_k[1] = 71"), "InvalidArgumentError: cu_seqlens_k must start at 0 and never "
                                                     "decrease"),
    (_COMPILED_PACKED.format(change="cu_q[2] = 6"), "InvalidArgumentError: cu_seqlens_q ends at 6, past the 5 packed "
                                                    "rows"),
], ids=["pool-strided-head-dim", "pool-row-stride", "cache-rows-strided-head-dim", "cache-rows-row-stride",
        "short-cache-seqlens", "short-k", "empty-v", "short-rotary-sin", "short-k-cache", "short-block-table",
        "compiled-page-id", "compiled-append-page-id", "compiled-append-cache-row", "compiled-append-capacity",
        "compiled-cu-seqlens-k-past-the-end", "compiled-cu-seqlens-k-decreasing", "compiled-cu-seqlens-q-past-the-rows"])
def test_hostile_cache_and_packed_calls_are_refused_in_their_own_process(host_build, setup, message):
    out = _run(_HOSTILE.format(setup=textwrap.dedent(setup)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert message in out.stdout, out.stdout + out.stderr[-3000:]
    assert "changed: []" in out.stdout


@pytest.mark.parametrize("entry, kw", [("varlen_attn", {"scale": 3e38}),
                                       ("flash_attn_varlen_func", {"softmax_scale": -3e38})])
def test_a_varlen_scale_beyond_float32_is_refused(host_build, entry, kw):
    q = torch.randn(5, 2, 64).half()
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    name = next(iter(kw))
    with pytest.raises(InvalidArgumentError, match=f"{name} -?3e\\+38 times log2\\(e\\) is beyond float32's range"):
        getattr(rdnattention, entry)(q, q, q, cu, cu, 3, 3, **kw)


# --- availability: what is on the search path never stops the runtime ---------------------------

def test_a_foreign_table_with_null_fields_does_not_break_the_lookup(host_copy, tmp_path, monkeypatch):
    import json

    from rdnattention import cli, dispatch
    from rdnattention.errors import KernelsNotBuiltError
    foreign = tmp_path / "foreign"
    (foreign / "gfx1030").mkdir(parents=True)
    (foreign / "gfx1030" / "dispatch.json").write_text(json.dumps(
        {"format": 3, "platform": "amdgcn", "isa_targets": None, "code_object_version": [None], "kernels": None}))
    monkeypatch.setattr(dispatch, "search_path", lambda: [foreign, tmp_path])
    dispatch.table_for.cache_clear()
    assert dispatch.table_for("host").target == "host"
    with pytest.raises(KernelsNotBuiltError, match="no kernels built for target 'gfx1031'"):
        dispatch.table_for("gfx1031")  # the error path reads every table (same_isa_tables)
    assert cli._amd_code_object_versions() == []  # no AMD table records a version; the foreign list is ignored
    dispatch.table_for.cache_clear()


def test_a_kernel_distribution_that_raises_on_import_is_skipped_with_a_warning(host_build, tmp_path, monkeypatch):
    import importlib.metadata

    from rdnattention import cli, dispatch
    (tmp_path / "broken_kernels" / "kernels").mkdir(parents=True)
    (tmp_path / "broken_kernels" / "__init__.py").write_text("raise RuntimeError('broken on import')\n")
    (tmp_path / "broken_kernels" / "kernels" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = importlib.metadata.EntryPoint(name="broken", value="broken_kernels.kernels", group=dispatch.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [ep] if group else [])
    monkeypatch.setattr(dispatch, "_skipped", set())
    with pytest.warns(RuntimeWarning, match="kernel distribution 'broken' .* skipped: RuntimeError: broken on import"):
        roots = dispatch.kernel_roots()
    assert not any("broken" in r.source for r in roots)
    dispatch.table_for.cache_clear()
    q = torch.randn(1, 2, 8, 64).half()
    assert flash_attn(q, q, q).shape == q.shape
    assert "devices" in cli.info()


@pytest.mark.parametrize("value", ["relative/dir", ".", ""])
def test_a_relative_xdg_data_home_is_ignored(monkeypatch, value):
    from pathlib import Path

    from rdnattention import dispatch
    monkeypatch.setenv("XDG_DATA_HOME", value)
    assert dispatch.user_kernel_dir() == Path.home() / ".local" / "share" / "rdnattention" / "kernels"
    monkeypatch.setenv("XDG_DATA_HOME", "/srv/data")
    assert dispatch.user_kernel_dir() == Path("/srv/data/rdnattention/kernels")


def test_build_user_into_a_file_is_a_one_line_error(tmp_path):
    afile = tmp_path / "a_file"
    afile.write_text("")
    out = subprocess.run([sys.executable, "-m", "rdnattention_gen.cli", "build", "--user", "--targets", "host"],
                         capture_output=True, text=True, cwd=REPO_ROOT, env={**os.environ, "XDG_DATA_HOME": str(afile)},
                         timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"cannot create the per-user kernel directory {afile}/rdnattention/kernels" in out.stderr


@pytest.mark.parametrize("content", ['{"target": "gfx1030", "family": "f16", "candidates": [{"name": '
                                     '"fa2_f16_hd64_g1_br64_bc64_nt128_tm4_w32_dot2_sf16", "row": null, '
                                     '"problems": [], "default": true, "whens": [[1]]}]}', "[1]", "null"])
def test_a_malformed_tune_json_is_a_one_line_error(tmp_path, content):
    (tmp_path / "tune.json").write_text(content)
    out = subprocess.run([sys.executable, "-m", "rdnattention_gen.cli", "tune", "--targets", "gfx1030", "--build-dir",
                          str(tmp_path), "--no-build"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{tmp_path / 'tune.json'}: not a candidate list this version wrote" in out.stderr


@pytest.mark.parametrize("quantize", ["quantize_per_token", "quantize_per_channel"])
def test_tiny_values_quantize_to_a_usable_scale(quantize):
    x = torch.full((1, 2, 8, 64), 1e-44)
    x[0, 1, :, 3] = 1e-30
    q, scale = getattr(rdnattention, quantize)(x)
    assert bool((scale >= torch.finfo(torch.float32).tiny).all()) and bool(torch.isfinite(scale).all())
    back = q.float() * (scale[..., None] if quantize == "quantize_per_token" else scale[:, :, None, :])
    assert (back - x).abs().max().item() <= torch.finfo(torch.float32).tiny * 127


@pytest.mark.parametrize("entry", ["flash_attn", "flash_attn_func", "kvcache", "varlen"])
@pytest.mark.parametrize("name", ["softmax_scale", "softcap"])
def test_an_unhashable_option_after_a_replayed_call_is_a_typed_error(host_build, entry, name):
    """A list given for a number, once the geometry is planned (the replay key holds the options):
    the full path's typed error, not the replay lookup's TypeError."""
    from test_refusal_properties import ENTRIES
    fn, tensors, kwargs = ENTRIES[entry]()
    fn(**tensors, **kwargs)
    with pytest.raises(InvalidArgumentError, match=name):
        fn(**tensors, **kwargs, **{name: [0.1]})
