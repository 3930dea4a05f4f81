"""The launch ABI of an AMD kernel, proven at build time: what the code object says a dispatch must
provide (its metadata note and kernel descriptor, read by hsaco.py) against what the runtime's
launch provides (one argument struct by value, the tile's threads as the block, no hidden
arguments, static LDS). A mismatch is an audit violation, so such a kernel is never shipped.

Each check is small and named; a finding is one line: the field, what the code object says, and
what the launch needs."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable

from rdnattention.families import family as runtime_family

from .hsaco import CodeObject
from .spec import KernelSpec
from .target import Target

# User SGPRs a kernel may ask the dispatch for. The kernarg segment pointer carries our struct.
# The private segment buffer is the scratch resource the command processor builds from the queue
# for every dispatch; LLVM enables it on every gfx9/gfx10 kernel (gfx11 has architected flat
# scratch), and with no scratch and no stack (checked below) it is never dereferenced. Any other
# (dispatch or queue pointer, dispatch id, flat scratch init, private segment size) reads
# dispatch-packet or queue data that HIP's module launch is not proven to give.
REQUIRED_USER_SGPRS = ("kernarg_segment_ptr",)
ALLOWED_USER_SGPRS = ("private_segment_buffer", "kernarg_segment_ptr")


@dataclass(frozen=True)
class RuntimeLaunch:
    """What the runtime passes when it launches a kernel (families' plan(), drivers' launch)."""

    struct: str      # the argument struct's C name
    size: int        # ctypes.sizeof of it: the kernel-argument bytes
    align: int       # ctypes.alignment of it
    block: int       # threads per workgroup: the tile's threads
    wave_size: int
    lds_bytes: int   # the LDS layout the kernel is built for (static: the launch asks for none)

    @classmethod
    def of(cls, target: Target, spec: KernelSpec) -> RuntimeLaunch:
        struct = runtime_family(spec.family).ARGS
        return cls(struct=struct.name, size=ctypes.sizeof(struct.ctype), align=ctypes.alignment(struct.ctype),
                   block=spec.tile.threads, wave_size=target.wave_size, lds_bytes=spec.lds_bytes)


def facts(code_object: CodeObject, kernel: str) -> dict:
    """What the code object says a dispatch of ``kernel`` needs, as JSON data (the audit caches it)."""
    meta, kd = code_object.kernels[kernel], code_object.descriptor(kernel)
    return {
        "args": [{"offset": a.get(".offset"), "size": a.get(".size"), "value_kind": a.get(".value_kind")}
                 for a in meta.get(".args", [])],
        "kernarg_segment_size": meta[".kernarg_segment_size"],
        "kernarg_segment_align": meta[".kernarg_segment_align"],
        "max_flat_workgroup_size": meta[".max_flat_workgroup_size"],
        "uses_dynamic_stack": bool(meta.get(".uses_dynamic_stack", False)),  # v5 and later
        "descriptor": {
            "kernarg_size": kd.kernarg_size,
            "wave_size": kd.wave_size,
            "group_segment_fixed_size": kd.group_segment_fixed_size,
            "private_segment_fixed_size": kd.private_segment_fixed_size,
            "uses_dynamic_stack": kd.uses_dynamic_stack,
            "user_sgprs": [name for name, _ in kd.user_sgprs],
        },
    }


# A finding: (field, found, expected and why).
Finding = tuple[str, object, str]


def _sizeof(r: RuntimeLaunch) -> str:
    return f"{r.size} = sizeof({r.struct}), the struct the runtime passes"


def _arguments(f: dict, r: RuntimeLaunch) -> list[Finding]:
    hidden = [a["value_kind"] for a in f["args"] if str(a["value_kind"]).startswith("hidden_")]
    explicit = [(i, a) for i, a in enumerate(f["args"]) if not str(a["value_kind"]).startswith("hidden_")]
    out: list[Finding] = []
    if hidden:
        out.append((".args (hidden)", ", ".join(hidden), f"none (the runtime passes only {r.struct})"))
    if len(explicit) != 1:
        out.append((".args", f"{len(explicit)} explicit arguments", f"1 (the {r.struct} the runtime passes by value)"))
    if explicit:
        i, a = explicit[0]
        if a["value_kind"] != "by_value":
            out.append((f".args[{i}].value_kind", a["value_kind"], "by_value"))
        if a["offset"] != 0:
            out.append((f".args[{i}].offset", a["offset"], "0"))
        if a["size"] != r.size:
            out.append((f".args[{i}].size", a["size"], _sizeof(r)))
    return out


def _kernarg_segment(f: dict, r: RuntimeLaunch) -> list[Finding]:
    out: list[Finding] = []
    if f["kernarg_segment_size"] != r.size:
        out.append((".kernarg_segment_size", f["kernarg_segment_size"], _sizeof(r)))
    if f["kernarg_segment_align"] < r.align:
        out.append((".kernarg_segment_align", f["kernarg_segment_align"],
                    f"at least {r.align} = alignment of {r.struct}"))
    if f["descriptor"]["kernarg_size"] != r.size:
        out.append(("descriptor.kernarg_size", f["descriptor"]["kernarg_size"], _sizeof(r)))
    return out


def _workgroup(f: dict, r: RuntimeLaunch) -> list[Finding]:
    out: list[Finding] = []
    if f["max_flat_workgroup_size"] != r.block:
        out.append((".max_flat_workgroup_size", f["max_flat_workgroup_size"],
                    f"{r.block} (the tile's threads: the block the runtime launches)"))
    if f["descriptor"]["wave_size"] != r.wave_size:
        out.append(("descriptor.wavefront_size32", f"wave{f['descriptor']['wave_size']}",
                    f"wave{r.wave_size} (the target's wave size)"))
    return out


def _memory(f: dict, r: RuntimeLaunch) -> list[Finding]:
    kd = f["descriptor"]
    out: list[Finding] = []
    if kd["group_segment_fixed_size"] != r.lds_bytes:
        out.append(("descriptor.group_segment_fixed_size", kd["group_segment_fixed_size"],
                    f"{r.lds_bytes} (the kernel's LDS layout)"))
    if kd["private_segment_fixed_size"]:
        out.append(("descriptor.private_segment_fixed_size", kd["private_segment_fixed_size"], "0 (no scratch)"))
    if f["uses_dynamic_stack"]:
        out.append((".uses_dynamic_stack", "true", "false (the runtime reserves no stack)"))
    if kd["uses_dynamic_stack"]:
        out.append(("descriptor.uses_dynamic_stack", "1", "0 (the runtime reserves no stack)"))
    return out


def _user_sgprs(f: dict, r: RuntimeLaunch) -> list[Finding]:
    enabled = f["descriptor"]["user_sgprs"]
    if set(enabled) <= set(ALLOWED_USER_SGPRS) and set(REQUIRED_USER_SGPRS) <= set(enabled):
        return []
    return [("descriptor user SGPRs", ", ".join(enabled) or "none",
             "kernarg_segment_ptr and at most private_segment_buffer (no dispatch-packet or queue data)")]


CHECKS: dict[str, Callable[[dict, RuntimeLaunch], list[Finding]]] = {
    "arguments": _arguments,
    "kernarg_segment": _kernarg_segment,
    "workgroup": _workgroup,
    "memory": _memory,
    "user_sgprs": _user_sgprs,
}


def violations(launch_facts: dict, runtime: RuntimeLaunch) -> list[str]:
    """Every way the code object's launch ABI differs from the runtime's launch, one line each."""
    return [f"launch ABI: {field} is {found}, expected {expected}"
            for check in CHECKS.values() for field, found, expected in check(launch_facts, runtime)]
