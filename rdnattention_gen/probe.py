"""Ask the compiler what each target accepts, and compare with what variants.yaml claims."""

from __future__ import annotations

import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .target import Target
from .toolchain import Toolchain

_HEADER = """typedef _Float16 half2_t __attribute__((ext_vector_type(2)));
typedef __bf16 bf16x2_t __attribute__((ext_vector_type(2)));
extern "C" __attribute__((global)) void probe(float* f, int* i, const half2_t* h) {
"""
PROBES = {
    "fdot2": "f[0] = __builtin_amdgcn_fdot2(h[0], h[1], f[1], false);",
    "sdot4": "i[0] = __builtin_amdgcn_sdot4(i[1], i[2], i[3], false);",
    "sudot4": "i[0] = __builtin_amdgcn_sudot4(true, i[1], false, i[2], i[3], false);",
    "fma_mix": "f[0] = __builtin_fmaf((float)h[0].x, (float)h[1].x, f[1]);",
    "bf16_dot": "f[0] = __builtin_amdgcn_fdot2_f32_bf16(__builtin_bit_cast(bf16x2_t, i[1]), "
                "__builtin_bit_cast(bf16x2_t, i[2]), f[1], false);",
}


def claimed(target: Target) -> dict[str, bool]:
    return {"fdot2": target.fdot2, "sdot4": target.int8_dot == "sdot4",
            "sudot4": target.int8_dot == "sudot4", "fma_mix": target.mixed_fma == "fma_mix",
            "bf16_dot": target.bf16_dot}


def _probe_one(tc: Toolchain, target: str, feature: str, workdir: Path) -> bool:
    src = workdir / f"{target}_{feature}.hip"
    out = src.with_suffix(".o")
    src.write_text(_HEADER + PROBES[feature] + "\n}\n")
    cmd = [tc.clang, "-x", "hip", "--offload-device-only", "-nogpuinc", "-nogpulib", "--no-gpu-bundle-output",
           f"--offload-arch={target}", "-O2", str(src), "-o", str(out)]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        return False
    if feature != "fma_mix":
        return True
    asm = subprocess.run([tc.objdump, "-d", str(out)], capture_output=True, text=True).stdout
    return "v_fma_mix_f32" in asm


def probe(tc: Toolchain, targets: list[Target]) -> dict[str, dict[str, bool]]:
    """{target: {feature: accepted}} for every amdgcn target."""
    targets = [t for t in targets if t.platform == "amdgcn"]
    with tempfile.TemporaryDirectory(prefix="rdna-probe-") as tmp, ThreadPoolExecutor() as pool:
        jobs = {(t.name, f): pool.submit(_probe_one, tc, t.name, f, Path(tmp)) for t in targets for f in PROBES}
        return {t.name: {f: jobs[(t.name, f)].result() for f in PROBES} for t in targets}
