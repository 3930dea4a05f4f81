"""The HIP side without an AMD GPU: target parsing and overrides, library resolution, symbol
binding against a real HIP runtime (Debian's libamdhip64-5, which loads without a GPU), the
no-device error, and the dispatch fallback between ISA-identical targets. The launch itself needs
an AMD GPU and is not exercised here."""

import ctypes.util
import json
import shutil

import pytest
import torch

from rdnattention import dispatch, drivers
from rdnattention.drivers import hip
from rdnattention.drivers.module_api import ModuleApi, ModuleDriver
from rdnattention.errors import KernelsNotBuiltError, LaunchError, UnsupportedError


@pytest.mark.parametrize("name, arch", [("gfx1030:sramecc-:xnack-", "gfx1030"), ("gfx906:sramecc+:xnack-", "gfx906"),
                                        ("gfx90c", "gfx90c"), ("gfx1100", "gfx1100")])
def test_gcn_arch_name_loses_its_features(name, arch):
    assert hip.parse_arch(name) == arch


def test_unreadable_arch_name():
    with pytest.raises(UnsupportedError, match="cannot read a gfx target from the device's gcnArchName 'sm_90'"):
        hip.parse_arch("sm_90")


@pytest.mark.parametrize("value, arch", [("10.3.0", "gfx1030"), ("9.0.6", "gfx906"), ("9.0.12", "gfx90c"),
                                         ("11.0.0", "gfx1100"), (" 10.1.2 ", "gfx1012")])
def test_hsa_override_reads_as_rocm_does(value, arch):
    assert hip.override_arch(value) == arch


@pytest.mark.parametrize("value", ["10.3", "gfx1030", "10.3.16", ""])
def test_bad_hsa_override(value):
    with pytest.raises(UnsupportedError, match="is not major.minor.stepping"):
        hip.override_arch(value)


def test_override_and_forced_target_take_precedence(monkeypatch):
    device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: type("P", (), {"gcnArchName": "gfx1032:sramecc-:xnack-"})())
    hip._device_arch.cache_clear()
    monkeypatch.delenv("HSA_OVERRIDE_GFX_VERSION", raising=False)
    monkeypatch.delenv("RDNATTENTION_TARGET", raising=False)
    assert drivers.for_device(device) is hip and drivers.target_of(device) == "gfx1032"
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "10.3.0")
    assert drivers.target_of(device) == "gfx1030"
    monkeypatch.setenv("RDNATTENTION_TARGET", "gfx1031")
    assert drivers.target_of(device) == "gfx1031"
    hip._device_arch.cache_clear()


def test_cpu_tensors_ignore_the_forced_gpu_target(monkeypatch):
    monkeypatch.setenv("RDNATTENTION_TARGET", "gfx1030")
    monkeypatch.delenv("RDNATTENTION_HOST_TARGET", raising=False)
    assert drivers.target_of(torch.device("cpu")) == "host"


def test_a_second_runtime_copy_is_refused(monkeypatch):
    monkeypatch.setattr(hip, "mapped_libraries", lambda: ["/opt/rocm/lib/libamdhip64.so.6"])
    monkeypatch.setenv(hip.LIBRARY_ENV, "/elsewhere/libamdhip64.so.6")
    with pytest.raises(LaunchError, match="is not the HIP runtime this process already uses"):
        hip.library_path()
    monkeypatch.delenv(hip.LIBRARY_ENV)
    assert hip.library_path() == "/opt/rocm/lib/libamdhip64.so.6"
    monkeypatch.setattr(hip, "mapped_libraries", lambda: ["/a/libamdhip64.so", "/b/libamdhip64.so"])
    with pytest.raises(LaunchError, match="two HIP runtimes are mapped"):
        hip.library_path()


def test_no_runtime_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(hip, "mapped_libraries", lambda: [])
    monkeypatch.setattr(hip.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(hip.torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "rocm"))
    monkeypatch.delenv(hip.LIBRARY_ENV, raising=False)
    with pytest.raises(LaunchError, match="no HIP runtime .libamdhip64. found.*Install ROCm PyTorch"):
        hip.library_path()


def test_a_library_without_the_symbols_is_refused():
    libc = ctypes.util.find_library("c")
    driver = ModuleDriver(hip.API, lambda: libc)
    with pytest.raises(LaunchError, match="lacks hipModuleLoadData, hipModuleGetFunction, hipModuleLaunchKernel, "
                                          "hipGetErrorString, hipModuleOccupancyMaxActiveBlocksPerMultiprocessor: "
                                          "not a HIP runtime"):
        driver.library()
    with pytest.raises(LaunchError, match="cannot load the HIP library /no/such/libamdhip64.so"):
        ModuleDriver(hip.API, lambda: "/no/such/libamdhip64.so").library()


needs_hip_runtime = pytest.mark.skipif(ctypes.util.find_library("amdhip64") is None,
                                       reason="needs a HIP runtime library (Debian: apt-get install libamdhip64-5)")


@needs_hip_runtime
def test_every_symbol_binds_against_a_real_hip_runtime():
    driver = ModuleDriver(hip.API, hip.library_path)
    lib = driver.library()
    assert all(hasattr(lib, s) for s in hip.API.symbols)
    assert driver.error_text(100) == "hipErrorNoDevice"
    assert hip.library_path() in hip.mapped_libraries()  # now the process's copy


@needs_hip_runtime
def test_no_device_is_a_typed_error():
    with pytest.raises(UnsupportedError, match="reports no usable GPU: hipErrorNoDevice"):
        hip.device_count()


def test_cuda_api_binds_the_same_shape():
    assert hip.API.symbols == ("hipModuleLoadData", "hipModuleGetFunction", "hipModuleLaunchKernel",
                               "hipGetErrorString", "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor")
    assert isinstance(drivers.cuda.API, ModuleApi) and drivers.cuda.API.set_attribute == "cuFuncSetAttribute"


@pytest.fixture()
def gfx1030_only(default_audit, build_dir, tmp_path, monkeypatch):
    """A kernel directory holding only gfx1030's build."""
    shutil.copytree(build_dir / "gfx1030", tmp_path / "gfx1030", ignore=shutil.ignore_patterns("*.o", "*.d"))
    monkeypatch.setattr(dispatch, "search_path", lambda: [tmp_path])
    dispatch.table_for.cache_clear()
    yield tmp_path
    dispatch.table_for.cache_clear()


def test_isa_identical_targets_fall_back(gfx1030_only):
    data = json.loads((gfx1030_only / "gfx1030" / "dispatch.json").read_text())
    assert data["isa_targets"] == ["gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035", "gfx1036"]
    for target in data["isa_targets"]:
        assert dispatch.table_for(target).target == "gfx1030"
    assert dispatch.fallback_chain("gfx1034") == [gfx1030_only / "gfx1030" / "dispatch.json"]


def test_an_unknown_gpu_names_itself_the_built_targets_and_the_command(gfx1030_only):
    with pytest.raises(KernelsNotBuiltError) as err:
        dispatch.table_for("gfx1100", "AMD Radeon RX 7900 XTX")
    msg = str(err.value)
    assert msg.startswith("no kernels built for AMD Radeon RX 7900 XTX (gfx1100)")
    assert "built targets there: gfx1030" in msg and msg.endswith("rdnattention-gen build --targets gfx1100")
