"""rdnattention info / doctor: which kernels this machine would use and why, and whether they work.

    rdnattention info [--json]      (also: python -m rdnattention info)
    rdnattention doctor
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from . import __version__, dispatch, drivers
from .errors import IncompatibleKernelsError, KernelsNotBuiltError, LaunchError, RdnaAttentionError, UnsupportedError
from .families import FAMILIES
from .table import TargetTable

ENV = ("RDNATTENTION_TARGET", "RDNATTENTION_HOST_TARGET", "HSA_OVERRIDE_GFX_VERSION", "RDNATTENTION_BUILD_DIR",
       "XDG_DATA_HOME",
       "RDNATTENTION_HIP_LIBRARY", "RDNATTENTION_HOST_THREADS", "ROCM_PATH")


def _devices() -> list[torch.device]:
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return devices


def _device_facts(device: torch.device) -> dict:
    if device.type == "cpu":
        return {"device": "cpu", "name": platform.processor() or platform.machine(), "arch": "host emulator"}
    props = torch.cuda.get_device_properties(device)
    arch = getattr(props, "gcnArchName", "") if torch.version.hip else f"sm_{props.major}{props.minor}"
    return {"device": str(device), "name": props.name, "arch": arch}


def _table_facts(table: TargetTable) -> dict:
    families = {}
    for name in sorted({e.family for e in table.kernels}):
        entries = [e for e in table.kernels if e.family == name]
        ours = FAMILIES[name].ARGS.digest
        families[name] = {
            "head_dims": sorted({e.head_dim for e in entries if e.dtype is None}),
            # head_dims of the kernels of each dtype option (bf16)
            "dtype_head_dims": {d: sorted({e.head_dim for e in entries if e.dtype == d})
                                for d in sorted({e.dtype for e in entries if e.dtype is not None})},
            "gqa_groups": sorted({e.gqa_group for e in entries}),
            "tiers": sorted({e.tier for e in entries}),
            "kernels": len(entries),
            "args_digest": sorted({e.args_digest for e in entries}),
            "runtime_args_digest": ours,
            "constrained_entries": [f"{e.name} ({e.when}, {e.provenance})" for e in entries if e.priority in (1, 3)],
            "alternates": sum(1 for e in entries if e.priority < 0),
        }
    version = table.code_object_version
    return {"target": table.target, "platform": table.platform, "code_object": str(table.code_object),
            "code_object_version": version,
            "loads_on": dispatch.rocm_floor(version) if version in dispatch.ROCM_LOADS else None,
            "isa_targets": list(table.isa_targets), "families": families,
            "dtypes": ["float16"] + (["bfloat16"] if any(e.dtype == "bf16" for e in table.kernels) else [])
                      + (["int8 (flash_attn_int8qk)"] if "i8" in families else []),
            "features": ["causal", "sliding window", "GQA/MQA", "cross-attention and decode",
                         "RoPE (rotate-half, interleaved)", "log-sum-exp", "any strides"]}


def device_info(device: torch.device) -> dict:
    facts = _device_facts(device)
    try:
        driver = drivers.for_device(device)
        target = drivers.target_of(device)
    except RdnaAttentionError as e:
        return {**facts, "error": f"{type(e).__name__}: {e}"}
    facts.update(platform=driver.PLATFORM, target=target,
                 fallback_chain=[str(p) for p in dispatch.fallback_chain(target)])
    if device.type != "cpu":
        try:
            facts["driver_library"] = driver.library_path()
        except RdnaAttentionError as e:
            facts["driver_library"] = f"{type(e).__name__}: {e}"
    try:
        facts["kernels"] = _table_facts(dispatch.table_for(target))
    except RdnaAttentionError as e:
        facts["kernels"] = {"error": f"{type(e).__name__}: {e}"}
    return facts


def _amd_code_object_versions() -> list[int]:
    """The AMD code object versions the built tables record (a table that cannot be read says so
    where it is chosen, not here)."""
    versions = set()
    for path in dispatch.built_tables():
        try:
            version = json.loads(path.read_text()).get("code_object_version")
            if type(version) is int:
                versions.add(version)
        except (OSError, ValueError, AttributeError):
            continue
    return sorted(v for v in versions if v in dispatch.ROCM_LOADS)


def info() -> dict:
    return {
        "rdnattention": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": torch.version.hip,
        "environment": {k: os.environ[k] for k in ENV if k in os.environ},
        "kernel_search_path": [{"path": str(r.path), "source": r.source,
                                "targets": sorted(p.parent.name for p in r.path.glob("*/dispatch.json"))}
                               for r in dispatch.kernel_roots()],
        "built_targets": sorted({p.parent.name for p in dispatch.built_tables()}),
        "amd_code_objects": [dispatch.rocm_floor(v) for v in _amd_code_object_versions()],
        "devices": [device_info(d) for d in _devices()],
    }


def _print_info(data: dict) -> None:
    print(f"rdnattention {data['rdnattention']}, torch {data['torch']} (CUDA {data['torch_cuda']}, "
          f"HIP {data['torch_hip']}), Python {data['python']}")
    env = ", ".join(f"{k}={v}" for k, v in data["environment"].items()) or "none set"
    print(f"environment: {env}")
    print("kernels are looked for in, in order:")
    for r in data["kernel_search_path"]:
        print(f"  {r['path']} ({r['source']}): {', '.join(r['targets']) or 'nothing built'}")
    print("built targets: " + (", ".join(data["built_targets"]) or "none"))
    for floor in data["amd_code_objects"]:
        print(floor)
    for d in data["devices"]:
        print(f"\n{d['device']}: {d['name']} ({d['arch']})")
        if "error" in d:
            print(f"  {d['error']}")
            continue
        print(f"  platform {d['platform']}, target {d['target']}")
        if "driver_library" in d:
            print(f"  driver library: {d['driver_library']}")
        print("  tables that could serve it, in order: " + ("; ".join(d["fallback_chain"]) or "none"))
        k = d["kernels"]
        if "error" in k:
            print(f"  {k['error']}")
            continue
        print(f"  kernels: {k['code_object']}" + (f" ({k['loads_on']})" if k["loads_on"] else ""))
        for name, f in k["families"].items():
            match = "matches" if f["args_digest"] == [f["runtime_args_digest"]] else "DIFFERS from"
            print(f"  family {name}: {f['kernels']} kernels, head_dims {f['head_dims']}, GQA groups {f['gqa_groups']}, "
                  f"tier {', '.join(f['tiers'])}; argument layout {', '.join(f['args_digest'])} {match} the "
                  f"runtime's {f['runtime_args_digest']}")
            for entry in f["constrained_entries"]:
                print(f"    when-entry: {entry}")
        print(f"  dtypes: {', '.join(k['dtypes'])}; features: {', '.join(k['features'])}")


def _fix(e: Exception, target: str | None) -> str:
    """One command that fixes ``e`` when run as printed (or what to do where no command does)."""
    build = (f"pip install 'rdnattention[gen]' (clang-22 and lld-22 on PATH), then rdnattention-gen build --user "
             f"--targets {target}")
    if isinstance(e, IncompatibleKernelsError):
        return f"rebuild the kernels with this version: {build}"
    if isinstance(e, KernelsNotBuiltError):
        if target is not None and target.startswith("host"):
            return f"build the host emulator's kernels: {build}"
        return (f"install the kernel wheel that carries {target} (README, Install), or build them: {build}; a GPU of "
                "the same instruction set as a built target runs that target's kernels only when it reports it: set "
                "HSA_OVERRIDE_GFX_VERSION (the message names the value)")
    if isinstance(e, LaunchError):
        return "the driver refused the launch: check the GPU driver, then report the message above"
    if isinstance(e, UnsupportedError):
        return "see the message: this device or request is not served by this version"
    return "a wrong result: report it with the output of `rdnattention info`"


def _host_kernels_present() -> bool:
    return any(p.parent.name in ("host", "host_f32") for p in dispatch.built_tables())


def doctor(cpu: bool | None = None) -> int:
    """A small case on every GPU (and the CPU: with ``cpu=True``, or by default where host kernels
    are installed) against the float64 oracle; prints a fix per problem. Exit status 0 when every
    device checked works, 1 otherwise (and when there is nothing to check)."""
    from .reference import attention_reference
    from .api import flash_attn

    problems = 0
    devices = _devices()
    if cpu is None:
        cpu = _host_kernels_present()
    if not cpu:
        devices = [d for d in devices if d.type != "cpu"]
        print("skip  cpu: the host emulator is a correctness tool, far slower than torch's own CPU attention; "
              "no host kernels are installed (check it anyway: rdnattention doctor --cpu)")
    if not devices:
        print("doctor: no GPU that torch sees; nothing checked")
        return 1
    for device in devices:
        label = f"{device} ({_device_facts(device)['name']})"
        target = None
        try:
            target = drivers.target_of(device)
            g = torch.Generator().manual_seed(0)
            worst = 0.0
            for hq, hk, s, d in ((4, 2, 77, 64), (2, 2, 33, 128)):
                q, k, v = (torch.randn(1, h, s, d, generator=g).half() for h in (hq, hk, hk))
                with torch.inference_mode():
                    out = flash_attn(q.to(device), k.to(device), v.to(device), is_causal=True)
                err = (out.cpu().double() - attention_reference(q, k, v, is_causal=True)).abs().max().item()
                worst = max(worst, err)
            if not worst <= 2e-3:
                raise AssertionError(f"max abs error {worst:.2e} against the float64 oracle, above 2e-3")
            print(f"ok    {label}: target {target}, max abs error {worst:.1e} against the float64 oracle")
        except (RdnaAttentionError, AssertionError) as e:
            problems += 1
            print(f"FAIL  {label}: {type(e).__name__}: {e}\n      fix: {_fix(e, target)}")
    print("doctor: " + ("every device works" if not problems else f"{problems} device(s) with a problem"))
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rdnattention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("info", help="versions, devices, resolved targets and the kernels each would use")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    d = sub.add_parser("doctor", help="run a small case on every GPU against the oracle; print a fix per problem")
    d.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=None,
                   help="check the CPU (host emulator) too; default: where host kernels are installed")
    args = p.parse_args(argv)
    if args.command == "info":
        data = info()
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            _print_info(data)
        return 0
    return doctor(cpu=args.cpu)


if __name__ == "__main__":
    sys.exit(main())
