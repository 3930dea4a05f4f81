"""The build proves every AMD kernel's launch ABI against what the runtime passes (launch_abi.py):
the real build passes; a runtime struct that changed, a code object whose metadata or descriptor
says otherwise, and kernels that read the dispatch packet or hidden arguments fail it, one line
per field."""

import ctypes
import shutil
import struct

import msgpack
import pytest

from rdnattention.abi import ArgStruct
from rdnattention.families import f16 as runtime_f16
from rdnattention_gen import build, launch_abi
from rdnattention_gen.audit import AuditError
from rdnattention_gen.hsaco import USER_SGPRS, CodeObject

from tiny_amdgcn import ARGS_ALIGN, ARGS_SIZE, THREADS, compile_tiny

SIZEOF = "the struct the runtime passes"


def _amd_targets(matrix, rows):
    return sorted({r.target for r in rows if matrix.target(r.target).platform == "amdgcn"})


def test_every_amd_kernel_launches_as_the_runtime_launches(matrix, default_audit):
    targets = _amd_targets(matrix, default_audit)
    assert {"gfx1030", "gfx906", "gfx1011"} <= set(targets)
    for name in targets:
        target = matrix.target(name)
        specs = {s.name: s for s in matrix.specs_for(target)}
        rows = [r for r in default_audit if r.target == name]
        assert sorted(r.name for r in rows) == sorted(specs)
        for r in rows:
            runtime = launch_abi.RuntimeLaunch.of(target, specs[r.name])
            assert r.launch["args"] == [{"offset": 0, "size": runtime.size, "value_kind": "by_value"}], r.name
            assert r.launch["max_flat_workgroup_size"] == specs[r.name].tile.threads
            assert r.launch["descriptor"]["wave_size"] == target.wave_size
            assert launch_abi.violations(r.launch, runtime) == [], r.name


def test_a_runtime_struct_that_gained_a_field_fails_the_build(matrix, default_audit, build_dir, monkeypatch):
    """The generator rendered the old struct into the kernels; a runtime whose Fa2Args grew would
    pass more bytes than the kernels read. The cached audit rows are checked again, so the build fails
    without a recompile."""
    target = matrix.target("gfx1030")
    before = ctypes.sizeof(runtime_f16.ARGS.ctype)
    grown = ArgStruct(runtime_f16.ARGS.name, runtime_f16.ARGS.fields + (("extra", "long long"),))
    after = ctypes.sizeof(grown.ctype)
    assert after == before + 8
    monkeypatch.setattr(runtime_f16, "ARGS", grown)
    with pytest.raises(AuditError) as err:
        build.audit_target(matrix, target, build_dir)
    f16 = [s.name for s in matrix.specs_for(target) if s.family == "f16"]
    assert f16
    assert str(err.value).splitlines() == ["audit failed:"] + [
        f"  gfx1030/{name}: launch ABI: {field} is {before}, expected {after} = sizeof(Fa2Args), {SIZEOF}"
        for name in f16 for field in (".args[0].size", ".kernarg_segment_size", "descriptor.kernarg_size")]


def _patch(data: bytearray, old: bytes, new: bytes, before: int | None = None) -> None:
    """Replaces the one occurrence of ``old`` (the last one before offset ``before``) in place."""
    assert len(old) == len(new)
    at = data.rfind(old, 0, before) if before is not None else data.find(old)
    assert at >= 0 and (before is not None or data.find(old, at + 1) < 0)
    data[at:at + len(old)] = new


def test_a_code_object_that_disagrees_with_the_launch_fails_the_build(matrix, default_audit, build_dir, tmp_path):
    """A copy of gfx1030's build, its bytes edited: one kernel's metadata asks for 512 threads, another's
    descriptor enables the dispatch-packet pointer."""
    shutil.copytree(build_dir / "gfx1030", tmp_path / "gfx1030", ignore=shutil.ignore_patterns("*.o", "*.d"))
    target = matrix.target("gfx1030")
    path = build.code_object_path(target, tmp_path)
    co = CodeObject.read(path)
    wide, packet = [s.name for s in matrix.specs_for(target) if s.family == "f16" and s.tile.threads == 256][:2]
    data = bytearray(co.data)
    # The metadata note is msgpack; each kernel's map has its keys sorted, so .max_flat_workgroup_size
    # comes right before .name.
    key = msgpack.packb(".max_flat_workgroup_size")
    _patch(data, key + msgpack.packb(256), key + msgpack.packb(512),
           before=data.find(msgpack.packb(".name") + msgpack.packb(wide)))
    kd = co.read_vaddr(co.descriptor_address(packet), 64)
    props = struct.unpack_from("<H", kd, 56)[0]
    dispatch_ptr = next(bit for name, bit, _ in USER_SGPRS if name == "dispatch_ptr")
    _patch(data, kd, kd[:56] + struct.pack("<H", props | 1 << dispatch_ptr) + kd[58:])
    path.write_bytes(bytes(data))
    with pytest.raises(AuditError) as err:
        build.audit_target(matrix, target, tmp_path)  # the cached audit beside it is for the old file
    assert str(err.value).splitlines() == [
        "audit failed:",
        f"  gfx1030/{wide}: launch ABI: .max_flat_workgroup_size is 512, expected 256 (the tile's threads: "
        "the block the runtime launches)",
        f"  gfx1030/{packet}: launch ABI: descriptor user SGPRs is private_segment_buffer, dispatch_ptr, "
        "kernarg_segment_ptr, expected kernarg_segment_ptr and at most private_segment_buffer (no dispatch-packet "
        "or queue data)",
    ]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return CodeObject.read(compile_tiny(tmp_path_factory.mktemp("tiny")))


RUNTIME = launch_abi.RuntimeLaunch(struct="Args", size=ARGS_SIZE, align=ARGS_ALIGN, block=THREADS, wave_size=32,
                                   lds_bytes=0)


def test_a_plain_kernel_passes(tiny):
    assert launch_abi.violations(launch_abi.facts(tiny, "plain"), RUNTIME) == []


def test_a_kernel_that_reads_the_dispatch_packet_fails(tiny):
    assert launch_abi.violations(launch_abi.facts(tiny, "reads_dispatch_packet"), RUNTIME) == [
        "launch ABI: descriptor user SGPRs is private_segment_buffer, dispatch_ptr, kernarg_segment_ptr, expected "
        "kernarg_segment_ptr and at most private_segment_buffer (no dispatch-packet or queue data)"]


def test_a_kernel_with_hidden_arguments_fails(tiny):
    """At v4 the implicit-argument pointer brings the global offsets and four reserved slots."""
    assert launch_abi.violations(launch_abi.facts(tiny, "reads_hidden_arguments"), RUNTIME) == [
        "launch ABI: .args (hidden) is hidden_global_offset_x, hidden_global_offset_y, hidden_global_offset_z, "
        "hidden_none, hidden_none, hidden_none, hidden_none, expected none (the runtime passes only Args)",
        f"launch ABI: .kernarg_segment_size is 72, expected 16 = sizeof(Args), {SIZEOF}",
        f"launch ABI: descriptor.kernarg_size is 72, expected 16 = sizeof(Args), {SIZEOF}",
    ]


def test_every_field_the_launch_depends_on_is_checked(tiny):
    """A launch the plain kernel does not fit: another struct size and alignment, block, wave size, LDS."""
    other = launch_abi.RuntimeLaunch(struct="Args", size=24, align=16, block=128, wave_size=64, lds_bytes=16)
    assert launch_abi.violations(launch_abi.facts(tiny, "plain"), other) == [
        f"launch ABI: .args[0].size is 16, expected 24 = sizeof(Args), {SIZEOF}",
        f"launch ABI: .kernarg_segment_size is 16, expected 24 = sizeof(Args), {SIZEOF}",
        "launch ABI: .kernarg_segment_align is 8, expected at least 16 = alignment of Args",
        f"launch ABI: descriptor.kernarg_size is 16, expected 24 = sizeof(Args), {SIZEOF}",
        "launch ABI: .max_flat_workgroup_size is 64, expected 128 (the tile's threads: the block the runtime launches)",
        "launch ABI: descriptor.wavefront_size32 is wave32, expected wave64 (the target's wave size)",
        "launch ABI: descriptor.group_segment_fixed_size is 0, expected 16 (the kernel's LDS layout)",
    ]


def test_scratch_and_dynamic_stack_are_refused(tiny):
    facts = launch_abi.facts(tiny, "plain")
    facts = {**facts, "uses_dynamic_stack": True,
             "descriptor": {**facts["descriptor"], "private_segment_fixed_size": 32, "uses_dynamic_stack": True}}
    assert launch_abi.violations(facts, RUNTIME) == [
        "launch ABI: descriptor.private_segment_fixed_size is 32, expected 0 (no scratch)",
        "launch ABI: .uses_dynamic_stack is true, expected false (the runtime reserves no stack)",
        "launch ABI: descriptor.uses_dynamic_stack is 1, expected 0 (the runtime reserves no stack)",
    ]
