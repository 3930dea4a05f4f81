"""The host emulator as a race detector: a missing barrier changes results under shuffling."""

import ctypes
import subprocess

import pytest

from rdnattention_gen import HOST_DIR, toolchain
from rdnattention_gen.platforms.host import HOST_FLAGS
from rdnattention_gen.render import environment, render_prelude

HEADER = """
#include "prelude.h"
struct Probe { float* out; };
"""
KERNEL = """
// Each thread publishes its id, then reads its neighbour's slot.
RDNA_KERNEL(64) void probe_{name}(const Probe args) {
  RDNA_LDS(lds, 64 * sizeof(float));
  float* const slot = reinterpret_cast<float*>(lds);
  const int t = rdna_thread_id();
  slot[t] = -1.f;
  rdna_block_sync();
  slot[t] = (float)t;
  {sync}
  args.out[t] = slot[(t + 1) % 64];
}
RDNA_REGISTER(probe_{name}, Probe, 64)
"""


@pytest.fixture(scope="module")
def probe_lib(matrix, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("emulator")
    (tmp / "prelude.h").write_text(render_prelude(environment(), matrix.target("host")))
    src = tmp / "probe.cpp"
    src.write_text(HEADER + KERNEL.replace("{name}", "synced").replace("{sync}", "rdna_block_sync();") +
                   KERNEL.replace("{name}", "racy").replace("{sync}", ""))
    lib = tmp / "libprobe.so"
    tc = toolchain.find()
    subprocess.run(tc.clangxx + HOST_FLAGS.split() + ["-shared", "-DRDNA_WAVE_SIZE=32", f"-I{HOST_DIR}",
                    str(src), str(HOST_DIR / "rdna_host.cpp"), "-o", str(lib)], check=True)
    cdll = ctypes.CDLL(str(lib))
    cdll.rdna_host_last_error.restype = ctypes.c_char_p
    return cdll


def _run(lib, name, seed):
    out = (ctypes.c_float * 64)()
    args = ctypes.c_void_p(ctypes.addressof(out))
    grid = (ctypes.c_uint * 3)(1, 1, 1)
    rc = lib.rdna_host_launch(name.encode(), grid, 64, ctypes.byref(args), ctypes.sizeof(args),
                              ctypes.c_ulonglong(seed))
    assert rc == 0, lib.rdna_host_last_error()
    return list(out)


def test_synced_kernel_is_order_independent(probe_lib):
    expected = [float((t + 1) % 64) for t in range(64)]
    for seed in range(6):
        assert _run(probe_lib, "probe_synced", seed) == expected


def test_missing_barrier_is_caught_by_shuffling(probe_lib):
    results = {tuple(_run(probe_lib, "probe_racy", seed)) for seed in range(1, 7)}
    assert len(results) > 1, "shuffled fiber orders should expose the race"


def test_unknown_kernel_and_wrong_block_size(probe_lib):
    grid = (ctypes.c_uint * 3)(1, 1, 1)
    arg = ctypes.c_void_p(0)
    assert probe_lib.rdna_host_launch(b"nope", grid, 64, ctypes.byref(arg), 8, ctypes.c_ulonglong(0)) == -1
    assert probe_lib.rdna_host_last_error() == b"no kernel named nope in this library"
    assert probe_lib.rdna_host_launch(b"probe_racy", grid, 32, ctypes.byref(arg), 8, ctypes.c_ulonglong(0)) == -1
    assert b"launched with 32 threads" in probe_lib.rdna_host_last_error()
