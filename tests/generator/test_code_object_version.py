"""AMD code objects are built for the pinned code object version, the audit proves it from the ELF
header, and the dispatch table records it for the runtime."""

import json
import re
import shutil
import subprocess

import pytest

from conftest import REPO_ROOT

from rdnattention import dispatch as runtime_dispatch
from rdnattention.errors import IncompatibleKernelsError
from rdnattention_gen import build, toolchain
from rdnattention_gen.audit import AuditError
from rdnattention_gen.platforms import PLATFORMS

AMDGCN = PLATFORMS["amdgcn"]
# e_ident[EI_ABIVERSION] of an HSA code object (LLVM AMDGPUUsage: ELFABIVERSION_AMDGPU_HSA_V4..V6).
ELF_ABI_VERSION = {4: 2, 5: 3, 6: 4}


@pytest.fixture()
def gfx1030_copy(default_audit, build_dir, tmp_path):
    """A copy of gfx1030's build that a test may break."""
    shutil.copytree(build_dir / "gfx1030", tmp_path / "gfx1030", ignore=shutil.ignore_patterns("*.o", "*.d"))
    return tmp_path


def test_gfx1030_code_object_has_the_pinned_version(matrix, default_audit, build_dir):
    """Read the built file independently of the audit: llvm-readelf -h."""
    path = build.code_object_path(matrix.target("gfx1030"), build_dir)
    header = subprocess.run([toolchain.find().readelf, "-h", str(path)], capture_output=True, text=True,
                            check=True).stdout
    assert re.search(r"^\s*OS/ABI:\s+AMDGPU - HSA$", header, re.M), header
    abi = int(re.search(r"^\s*ABI Version:\s+(\d+)$", header, re.M)[1])
    assert abi == ELF_ABI_VERSION[AMDGCN.code_object_version]
    table = build_dir / "gfx1030" / "dispatch.json"
    assert json.loads(table.read_text())["code_object_version"] == AMDGCN.code_object_version
    assert runtime_dispatch.load_table(table).code_object_version == AMDGCN.code_object_version


def test_platforms_without_a_pin_record_null(host_build):
    assert PLATFORMS["host"].code_object_version is None and PLATFORMS["cuda"].code_object_version is None
    table = host_build / "host" / "dispatch.json"
    assert json.loads(table.read_text())["code_object_version"] is None
    assert runtime_dispatch.load_table(table).code_object_version is None


def test_the_audit_refuses_another_code_object_version(matrix, gfx1030_copy):
    target = matrix.target("gfx1030")
    path = build.code_object_path(target, gfx1030_copy)
    data = bytearray(path.read_bytes())
    data[8] = ELF_ABI_VERSION[6]
    path.write_bytes(bytes(data))
    n = AMDGCN.code_object_version
    message = (f"{path}: ELF ABI version {ELF_ABI_VERSION[6]} (code object v6), expected {ELF_ABI_VERSION[n]} "
               f"(code object v{n}, -mcode-object-version={n})")
    with pytest.raises(AuditError, match=re.escape(message)):
        build.audit_target(matrix, target, gfx1030_copy)  # the cached audit beside it is for the old file


@pytest.mark.parametrize("value, loaded", [(None, None), ("absent", None), (4, 4), (5, 5)])
def test_the_runtime_reads_the_version(gfx1030_copy, value, loaded):
    table = gfx1030_copy / "gfx1030" / "dispatch.json"
    data = json.loads(table.read_text())
    if value == "absent":
        del data["code_object_version"]
    else:
        data["code_object_version"] = value
    table.write_text(json.dumps(data))
    assert runtime_dispatch.load_table(table).code_object_version == loaded


def test_a_version_this_runtime_cannot_launch_is_stale(gfx1030_copy):
    from rdnattention.errors import StaleKernelsError
    table = gfx1030_copy / "gfx1030" / "dispatch.json"
    data = json.loads(table.read_text())
    data["code_object_version"] = 6
    table.write_text(json.dumps(data))
    with pytest.raises(StaleKernelsError, match=re.escape(
            "AMD code object v6 (loads on ROCm 6.2 and later); this runtime launches v4 (ROCm 4.1 and later) "
            "and v5 (ROCm 5.3 and later)")):
        runtime_dispatch.load_table(table)


@pytest.mark.parametrize("value", ["5", 5.0, True])
def test_a_version_that_is_not_an_integer_is_refused(gfx1030_copy, value):
    table = gfx1030_copy / "gfx1030" / "dispatch.json"
    data = json.loads(table.read_text())
    data["code_object_version"] = value
    table.write_text(json.dumps(data))
    with pytest.raises(IncompatibleKernelsError, match=re.escape(
            f"unreadable dispatch table (ValueError: code_object_version {value!r} is not an integer or null)")):
        runtime_dispatch.load_table(table)


def test_hardware_md_states_the_pinned_version():
    """docs/hardware.md names the version and the ROCm that loads it in prose; this keeps them from
    drifting from the constants."""
    n = AMDGCN.code_object_version
    text = " ".join((REPO_ROOT / "docs" / "hardware.md").read_text().split())
    assert f"code object version {n} (`-mcode-object-version={n}`). {runtime_dispatch.rocm_floor(n)}." in text
    assert f"is not {ELF_ABI_VERSION[n]}." in text


def test_the_pin_loads_on_every_rocm_a_supported_torch_ships():
    """torch 2.4, the oldest we support, ships ROCm 6.0 wheels; v4 loads from ROCm 4.1 (v5 from 5.3,
    v6 only from 6.2)."""
    assert AMDGCN.code_object_version == 4
    assert runtime_dispatch.ROCM_LOADS[AMDGCN.code_object_version] <= (6, 0)
    assert runtime_dispatch.rocm_floor(4) == "AMD code object v4 loads on ROCm 4.1 and later, every 6.x included"
    assert runtime_dispatch.rocm_floor(6) == "AMD code object v6 loads on ROCm 6.2 and later"


def test_rdnattention_info_states_the_floor(default_audit):
    from rdnattention import cli
    assert cli.info()["amd_code_objects"] == [runtime_dispatch.rocm_floor(AMDGCN.code_object_version)]
