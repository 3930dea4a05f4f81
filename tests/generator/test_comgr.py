"""Every built AMD code object is read by ROCm 5.2's code object manager (Debian 12's libamd-comgr2
5.2.3), the library hipModuleLoadData asks for a code object's ISA before it loads anything: what it
names is what HIP matches against the GPU, and what it refuses, HIP on that ROCm refuses to load.
A v5 code object is refused; that is why the build writes v4 (docs/hardware.md, "Code objects")."""

import json

import pytest

from rdnattention import dispatch
from rdnattention_gen import comgr
from rdnattention_gen.platforms import PLATFORMS

from tiny_amdgcn import compile_tiny

LOADER = comgr.find()
pytestmark = pytest.mark.skipif(LOADER is None, reason="libamd_comgr is not installed (Debian 12: apt-get install "
                                                       "libamd-comgr2; scripts/setup.sh installs it)")
INVALID_ARGUMENT = 2  # AMD_COMGR_STATUS_ERROR_INVALID_ARGUMENT
# comgr's interface version in ROCm 5.2 (Debian 12's 5.2.3): the last comgr that reads v4 but not v5.
ROCM_5_2 = (2, 4)


def _verdict(data: bytes) -> str:
    try:
        return LOADER.isa_name(data)
    except comgr.ComgrError as e:
        return f"status {e.status}"


def test_every_built_amd_code_object_names_its_isa(default_audit, build_dir):
    """Every amdgcn table in the build directory. A target this comgr does not know (gfx11 and later
    under ROCm 5.2) is refused whatever its code object version: it needs a later ROCm."""
    found, expected = {}, {}
    for table in sorted(build_dir.glob("*/dispatch.json")):
        data = json.loads(table.read_text())
        if data["platform"] != "amdgcn":
            continue
        target = table.parent.name
        found[target] = _verdict((table.parent / data["code_object"]).read_bytes())
        isa = f"amdgcn-amd-amdhsa--{target}"
        expected[target] = isa if isa in LOADER.isas else f"status {INVALID_ARGUMENT}"
    assert {"gfx1030", "gfx1036", "gfx1011", "gfx906"} <= set(found)
    assert found == expected


@pytest.mark.skipif(LOADER is not None and LOADER.version != ROCM_5_2,
                    reason=f"comgr interface {LOADER.version if LOADER else None} is not ROCm 5.2's {ROCM_5_2}")
@pytest.mark.parametrize("version, verdict", [(4, "amdgcn-amd-amdhsa--gfx1030"), (5, f"status {INVALID_ARGUMENT}"),
                                              (6, f"status {INVALID_ARGUMENT}")])
def test_rocm_5_2_reads_code_object_v4_only(tmp_path, version, verdict):
    assert _verdict(compile_tiny(tmp_path, "gfx1030", version).read_bytes()) == verdict


@pytest.mark.skipif(LOADER is not None and LOADER.version != ROCM_5_2,
                    reason=f"comgr interface {LOADER.version if LOADER else None} is not ROCm 5.2's {ROCM_5_2}")
def test_the_pinned_version_loads_where_the_floor_says():
    """ROCm 5.2 is above the floor we state for the pinned version and below v5's."""
    pinned = PLATFORMS["amdgcn"].code_object_version
    assert dispatch.ROCM_LOADS[pinned] <= (5, 2) < dispatch.ROCM_LOADS[5]


def test_rocm_5_2_knows_rdna2_but_not_rdna3():
    assert {"amdgcn-amd-amdhsa--gfx1030", "amdgcn-amd-amdhsa--gfx1036", "amdgcn-amd-amdhsa--gfx906"} <= set(LOADER.isas)
    if LOADER.version == ROCM_5_2:
        assert "amdgcn-amd-amdhsa--gfx1100" not in LOADER.isas
