"""Tiny AMD kernels compiled the way the build compiles ours (the amdgcn ninja rule's flags), for
tests that need a code object the generator would never produce: one that reads the dispatch
packet or hidden arguments, or one of another code object version."""

import subprocess
from pathlib import Path

from rdnattention_gen import toolchain
from rdnattention_gen.platform import DEVICE_FLAGS

# Args is 16 bytes, 8-aligned; every kernel is built for 64 threads.
SOURCE = """
struct Args { float* out; int n; };
#define KERNEL extern "C" __attribute__((global)) __attribute__((amdgpu_flat_work_group_size(64, 64)))
KERNEL void plain(Args a) {
  int i = (int)__builtin_amdgcn_workitem_id_x();
  if (i < a.n) a.out[i] = 1.0f;
}
KERNEL void reads_dispatch_packet(Args a) {
  int i = (int)__builtin_amdgcn_workitem_id_x();
  const unsigned short* packet = (const unsigned short*)__builtin_amdgcn_dispatch_ptr();
  if (i < a.n) a.out[i] = (float)packet[2];  // workgroup_size_x
}
KERNEL void reads_hidden_arguments(Args a) {
  int i = (int)__builtin_amdgcn_workitem_id_x();
  const int* implicit = (const int*)__builtin_amdgcn_implicitarg_ptr();
  if (i < a.n) a.out[i] = (float)implicit[0];
}
"""
ARGS_SIZE, ARGS_ALIGN, THREADS = 16, 8, 64


def compile_tiny(out_dir: Path, arch: str = "gfx1030", version: int = 4) -> Path:
    source = out_dir / "tiny.cpp"
    source.write_text(SOURCE)
    out = out_dir / f"tiny_{arch}_v{version}.hsaco"
    subprocess.run([toolchain.find().clang, "-x", "hip", "--offload-device-only", "-nogpuinc", "-nogpulib",
                    "--no-gpu-bundle-output", f"--offload-arch={arch}", f"-mcode-object-version={version}",
                    *DEVICE_FLAGS.split(), str(source), "-o", str(out)], check=True, capture_output=True)
    return out
