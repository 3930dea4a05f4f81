"""The intrinsics layer: each platform's int8 dot lowering compiles to the instruction the target
claims, and the host's C++ model computes what the GPU instructions compute."""

import ctypes
import random
import re
import subprocess

import pytest

from rdnattention_gen import HOST_DIR, toolchain
from rdnattention_gen.platforms.host import HOST_FLAGS, defines
from rdnattention_gen.render import environment, render_prelude

PROBE = """
#include "prelude.h"
struct Dot4Probe { const int* a; const int* b; const int* c; int* out; };
RDNA_KERNEL(64) void probe_dot4(const Dot4Probe p) {
  const int t = rdna_thread_id();
  p.out[t] = rdna_dot4_i8(p.a[t], p.b[t], p.c[t]);
}
RDNA_REGISTER(probe_dot4, Dot4Probe, 64)
"""


def _dot4(a: int, b: int, c: int) -> int:
    def lanes(x):
        return [((x >> (8 * i)) & 0xFF) - (256 if (x >> (8 * i)) & 0x80 else 0) for i in range(4)]
    total = c + sum(x * y for x, y in zip(lanes(a), lanes(b)))
    return (total + 2**31) % 2**32 - 2**31


@pytest.fixture(scope="module")
def tc():
    return toolchain.find()


def _write(tmp_path, matrix, target):
    (tmp_path / "prelude.h").write_text(render_prelude(environment(), matrix.target(target)))
    src = tmp_path / "probe.cpp"
    src.write_text(PROBE)
    return src


def test_host_dot4_model_wraps_like_the_hardware(matrix, tc, tmp_path):
    src = _write(tmp_path, matrix, "host")
    lib = tmp_path / "libprobe.so"
    subprocess.run(tc.clangxx + HOST_FLAGS.split() + ["-shared"] + defines(matrix.target("host")) +
                   [f"-I{HOST_DIR}", str(src), str(HOST_DIR / "rdna_host.cpp"), "-o", str(lib)], check=True)
    cdll = ctypes.CDLL(str(lib))
    rng = random.Random(7)
    edge = [-2**31, 2**31 - 1, 0, -1, 0x7F7F7F7F, -0x7F7F7F80]
    values = [[rng.randrange(-2**31, 2**31) for _ in range(64)] for _ in range(3)]
    values[0][:6], values[1][:6], values[2][:6] = edge, edge, edge[::-1]
    a, b, c = ((ctypes.c_int * 64)(*v) for v in values)
    out = (ctypes.c_int * 64)()
    args = (ctypes.c_void_p * 4)(*(ctypes.addressof(x) for x in (a, b, c, out)))
    grid = (ctypes.c_uint * 3)(1, 1, 1)
    assert cdll.rdna_host_launch(b"probe_dot4", grid, 64, ctypes.byref(args), ctypes.sizeof(args),
                                 ctypes.c_ulonglong(0), None, None, ctypes.c_size_t(0)) == 0
    assert list(out) == [_dot4(x, y, z) for x, y, z in zip(*values)]


# gfx10.3 picks the two-operand v_dot4c_i32_i8 (accumulating in place), gfx906 the three-operand form.
@pytest.mark.parametrize("target, instruction", [("gfx1030", r"v_dot4c?_i32_i8\b"), ("gfx906", r"v_dot4c?_i32_i8\b"),
                                                 ("gfx1100", r"v_dot4_i32_iu8\b"), ("gfx1201", r"v_dot4_i32_iu8\b")])
def test_amdgcn_dot4_lowering(matrix, tc, tmp_path, target, instruction):
    src = _write(tmp_path, matrix, target)
    out = tmp_path / "probe.hsaco"
    subprocess.run([tc.clang, "-x", "hip", "--offload-device-only", "-nogpuinc", "-nogpulib", "--no-gpu-bundle-output",
                    f"--offload-arch={target}", "-O3", "-std=c++17", str(src), "-o", str(out)], check=True)
    asm = subprocess.run([tc.objdump, "-d", str(out)], capture_output=True, text=True, check=True).stdout
    assert re.search(instruction, asm), asm


def test_cuda_dot4_lowering(matrix, tc, tmp_path):
    src = _write(tmp_path, matrix, "sm_61")
    ptx = tmp_path / "probe.ptx"
    subprocess.run([tc.clang, "-x", "cuda", "--cuda-device-only", "-nocudainc", "-nocudalib", "-Wno-unknown-cuda-version",
                    "--cuda-gpu-arch=sm_61", "-S", "-O3", "-std=c++17", str(src), "-o", str(ptx)], check=True)
    assert "dp4a.s32.s32" in ptx.read_text()


def test_targets_without_an_int8_dot_have_no_lowering(matrix):
    for name in ("gfx1010", "gfx900", "sm_60"):
        assert "rdna_dot4_i8" not in render_prelude(environment(), matrix.target(name))
