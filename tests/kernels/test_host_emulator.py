"""The host emulator as a race detector: a missing barrier changes results under shuffling. Both of
its fiber switches run every probe: the hand-written one (x86-64) and ucontext's (elsewhere)."""

import ctypes
import subprocess

import pytest

from rdnattention_gen import HOST_DIR, toolchain
from rdnattention_gen.platforms.host import HOST_FLAGS, defines
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
EXCHANGES = """
// Cross-lane exchanges back to back, at every distance within a wave, and a barrier between two.
RDNA_KERNEL(64) void probe_exchanges(const Probe args) {
  const int t = rdna_thread_id();
  float v = (float)t, sum = 0.f;
  for (int round = 0; round < 3; ++round) {
    for (int mask = 1; mask < RDNA_WAVE_SIZE; mask <<= 1) {
      v = rdna_shfl_xor(v, mask);
      sum += v * (float)(mask + round);
    }
    if (round == 1) rdna_block_sync();
  }
  args.out[t] = sum;
}
RDNA_REGISTER(probe_exchanges, Probe, 64)
// Half of every wave at a barrier, the other half exchanging: no thread can go on.
RDNA_KERNEL(64) void probe_mismatched(const Probe args) {
  const int t = rdna_thread_id();
  if (t % 2 == 0) rdna_block_sync();
  else args.out[t] = rdna_shfl_xor(1.f, 1);
}
RDNA_REGISTER(probe_mismatched, Probe, 64)
// Every fp16 bit pattern converted to fp32 as the kernels convert (the library's __extendhfsf2 on x86-64).
struct Halves { const unsigned short* in; float* out; };
RDNA_KERNEL(64) void probe_halves(const Halves args) {
  for (int i = rdna_thread_id(); i < 65536; i += 64) args.out[i] = (float)__builtin_bit_cast(_Float16, args.in[i]);
}
RDNA_REGISTER(probe_halves, Halves, 64)
"""


@pytest.fixture(scope="module", params=["switch", "ucontext"])
def probe_lib(request, matrix, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("emulator")
    (tmp / "prelude.h").write_text(render_prelude(environment(), matrix.target("host")))
    src = tmp / "probe.cpp"
    src.write_text(HEADER + KERNEL.replace("{name}", "synced").replace("{sync}", "rdna_block_sync();") +
                   KERNEL.replace("{name}", "racy").replace("{sync}", "") + EXCHANGES)
    lib = tmp / "libprobe.so"
    tc = toolchain.find()
    switch = ["-DRDNA_HOST_UCONTEXT"] if request.param == "ucontext" else []
    subprocess.run(tc.clangxx + HOST_FLAGS.split() + ["-shared"] + defines(matrix.target("host")) + switch +
                   [f"-I{HOST_DIR}", str(src), str(HOST_DIR / "rdna_host.cpp"), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def _launch(lib, name, seed, blocks=1):
    out = (ctypes.c_float * 64)()
    args = ctypes.c_void_p(ctypes.addressof(out))
    grid = (ctypes.c_uint * 3)(blocks, 1, 1)
    error = ctypes.create_string_buffer(256)
    rc = lib.rdna_host_launch(name.encode(), grid, 64, ctypes.byref(args), ctypes.sizeof(args),
                              ctypes.c_ulonglong(seed), None, error, ctypes.c_size_t(256))
    return rc, error.value, list(out)


def _run(lib, name, seed, blocks=1):
    rc, error, out = _launch(lib, name, seed, blocks)
    assert rc == 0, error
    return out


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
    error = ctypes.create_string_buffer(256)

    def launch(name, threads):
        return probe_lib.rdna_host_launch(name, grid, threads, ctypes.byref(arg), 8, ctypes.c_ulonglong(0), None,
                                          error, ctypes.c_size_t(256))
    assert launch(b"nope", 64) == -1 and error.value == b"no kernel named nope in this library"
    assert launch(b"probe_racy", 32) == -1 and b"launched with 32 threads" in error.value
    small = ctypes.create_string_buffer(8)
    assert probe_lib.rdna_host_launch(b"nope", grid, 64, ctypes.byref(arg), 8, ctypes.c_ulonglong(0), None,
                                      small, ctypes.c_size_t(8)) == -1
    assert small.value == b"no kern"  # truncated to the buffer, NUL-terminated


def test_a_cancelled_launch_stops_and_says_so(probe_lib):
    out = (ctypes.c_float * 64)()
    args = ctypes.c_void_p(ctypes.addressof(out))
    cancel = ctypes.c_int(1)
    error = ctypes.create_string_buffer(256)
    rc = probe_lib.rdna_host_launch(b"probe_synced", (ctypes.c_uint * 3)(4, 1, 1), 64, ctypes.byref(args),
                                    ctypes.sizeof(args), ctypes.c_ulonglong(0), ctypes.byref(cancel), error,
                                    ctypes.c_size_t(256))
    assert rc == 1 and error.value == b"probe_synced: interrupted"
    assert list(out) == [0.0] * 64  # no workgroup ran


def test_cross_lane_exchanges_in_any_fiber_order(probe_lib, matrix):
    wave = matrix.target("host").wave_size
    expected = []
    for t in range(64):
        v, total = t, 0.0
        for round_ in range(3):
            mask = 1
            while mask < wave:
                v ^= mask  # lane t reads lane t ^ mask's value: each lane's value moves along the masks
                total += v * (mask + round_)
                mask <<= 1
        expected.append(total)
    for seed in range(5):  # in order, then shuffled after every sync point; workgroups on several threads
        assert _run(probe_lib, "probe_exchanges", seed, blocks=8) == expected


def test_threads_at_different_sync_points_fail_the_launch(probe_lib):
    rc, error, _ = _launch(probe_lib, "probe_mismatched", 0)
    assert rc == -1
    assert error == (b"probe_mismatched: threads of workgroup (0,0,0) wait at different sync points: "
                     b"32 at a barrier, 32 at a wave sync, 0 finished")


def test_fp16_values_convert_exactly(probe_lib):
    """All 65536 fp16 bit patterns, against torch's conversion bit for bit (NaNs quieted, their
    payload and sign kept)."""
    import torch
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    out = torch.zeros(65536, dtype=torch.float32)
    args = (ctypes.c_void_p * 2)(halves.data_ptr(), out.data_ptr())
    error = ctypes.create_string_buffer(256)
    rc = probe_lib.rdna_host_launch(b"probe_halves", (ctypes.c_uint * 3)(1, 1, 1), 64, ctypes.byref(args),
                                    ctypes.sizeof(args), ctypes.c_ulonglong(0), None, error, ctypes.c_size_t(256))
    assert rc == 0, error.value
    assert torch.equal(out.view(torch.int32), halves.view(torch.float16).float().view(torch.int32))
