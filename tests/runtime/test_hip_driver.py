"""The HIP side without an AMD GPU: target parsing and overrides, library resolution, symbol
binding against a real HIP runtime (Debian's libamdhip64-5, which loads without a GPU), the
no-device error, no dispatch fallback between ISA-identical targets (HIP matches the exact ISA),
the code-object image kept as long as its module, and the Windows (HIP SDK) library resolution,
from fake module lists. The launch itself needs an AMD GPU and is not exercised here."""

import contextlib
import ctypes.util
import gc
import json
import os
import shutil
import types

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


WINDOWS_SDK = r"C:\Program Files\AMD\ROCm\6.2\bin\amdhip64_6.dll"
WINDOWS_TORCH = r"C:\Users\me\venv\Lib\site-packages\torch\lib\amdhip64.dll"


def fake_modules(monkeypatch, platform, paths):
    """The process's loaded libraries as ``platform``'s loader would list them."""
    monkeypatch.setattr(hip, "_windows_modules" if platform == "win32" else "_linux_mappings", lambda: list(paths))


@pytest.mark.parametrize("path, platform, runtime", [
    ("/opt/rocm/lib/libamdhip64.so.6.2.60200", "linux", True),
    ("/venv/torch/lib/libamdhip64.so", "linux", True),
    ("/opt/rocm/lib/libhiprtc.so.6", "linux", False),
    ("/opt/rocm/lib/libamd_comgr.so.2", "linux", False),
    (WINDOWS_SDK, "win32", True),
    (WINDOWS_TORCH, "win32", True),
    (r"C:\ROCm\7.1\bin\AMDHIP64_7.DLL", "win32", True),
    ("C:/ROCm/6.2/bin/amdhip64_6.dll", "win32", True),
    (r"C:\ROCm\6.2\bin\amdhip64_helper.dll", "win32", False),  # shares the prefix, not the runtime
    (r"C:\ROCm\6.2\bin\hiprtc0602.dll", "win32", False),
    (r"C:\ROCm\6.2\bin\amd_comgr_2.dll", "win32", False),
    (r"C:\ROCm\6.2\bin\amdhip64_6.dll.bak", "win32", False),
    (WINDOWS_SDK, "linux", False),
    ("/opt/rocm/lib/libamdhip64.so.6", "win32", False),
])
def test_runtime_names(path, platform, runtime):
    assert hip.is_runtime(path, platform) is runtime


def test_the_loaded_windows_runtime_is_found_among_the_modules(monkeypatch):
    monkeypatch.delenv(hip.LIBRARY_ENV, raising=False)
    fake_modules(monkeypatch, "win32", [r"C:\Python312\python.exe", r"C:\Windows\System32\KERNEL32.DLL",
                                        WINDOWS_TORCH, WINDOWS_TORCH.replace("amdhip64.dll", "hiprtc0602.dll"),
                                        WINDOWS_TORCH.replace("amdhip64.dll", "amd_comgr_2.dll")])
    assert hip.mapped_libraries("win32") == [WINDOWS_TORCH]
    assert hip.library_path("win32") == WINDOWS_TORCH


@pytest.mark.parametrize("platform, loaded, other", [
    ("linux", "/opt/rocm/lib/libamdhip64.so.6", "/elsewhere/libamdhip64.so.6"),
    ("win32", WINDOWS_TORCH, WINDOWS_SDK),
])
def test_a_second_runtime_copy_is_refused(monkeypatch, platform, loaded, other):
    fake_modules(monkeypatch, platform, [loaded, loaded])  # Linux maps a library in several segments
    monkeypatch.setenv(hip.LIBRARY_ENV, other)
    with pytest.raises(LaunchError, match="is not the HIP runtime this process already uses"):
        hip.library_path(platform)
    monkeypatch.setenv(hip.LIBRARY_ENV, loaded)
    assert hip.library_path(platform) == loaded
    monkeypatch.delenv(hip.LIBRARY_ENV)
    assert hip.library_path(platform) == loaded
    fake_modules(monkeypatch, platform, [loaded, other])
    with pytest.raises(LaunchError, match="two HIP runtimes are mapped"):
        hip.library_path(platform)


def test_windows_search_order(monkeypatch, tmp_path):
    """The loaded runtime, else torch's lib, then %HIP_PATH%\\bin, then PATH, then
    $RDNATTENTION_HIP_LIBRARY; a DLL that only shares the runtime's prefix is passed over."""
    impostor = tmp_path / "path0" / "amdhip64_helper.dll"
    found = [tmp_path / "torch" / "lib" / "amdhip64_7.dll", tmp_path / "sdk" / "bin" / "amdhip64_6.dll",
             tmp_path / "path1" / "amdhip64.dll", tmp_path / "explicit" / "amdhip64.dll"]
    for f in (impostor, *found):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.touch()
    monkeypatch.setattr(hip.torch, "__file__", str(tmp_path / "torch" / "__init__.py"))
    monkeypatch.setenv("HIP_PATH", str(tmp_path / "sdk"))
    monkeypatch.setenv("PATH", os.pathsep.join([str(impostor.parent), str(found[2].parent)]))
    monkeypatch.delenv(hip.LIBRARY_ENV, raising=False)
    fake_modules(monkeypatch, "win32", [WINDOWS_SDK])
    assert hip.library_path("win32") == WINDOWS_SDK
    fake_modules(monkeypatch, "win32", [])
    monkeypatch.setenv(hip.LIBRARY_ENV, str(found[3]))
    for library in found:
        assert hip.library_path("win32") == str(library)
        library.unlink()
    with pytest.raises(LaunchError, match=r"no HIP runtime \(amdhip64\*\.dll\) found.*Install the HIP SDK"):
        hip.library_path("win32")


def test_no_runtime_names_what_to_install(monkeypatch, tmp_path):
    fake_modules(monkeypatch, "linux", [])
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


def test_the_code_object_image_lives_as_long_as_its_module(monkeypatch, tmp_path):
    """ROCr keeps pointing into the image hipModuleLoadData was given: the driver must keep exactly
    that memory, with the code object's bytes, after the call returns and a collection runs."""
    code_object = tmp_path / "kernels.hsaco"
    code_object.write_bytes(bytes(range(256)) * 16)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    images = []

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
    def load(module, image):
        images.append(image)
        module[0] = 0x1000
        return 0

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p)
    def get_function(function, module, name):
        function[0] = module + 1
        return 0

    driver = ModuleDriver(hip.API, hip.library_path)
    driver._lib = types.SimpleNamespace(hipModuleLoadData=load, hipModuleGetFunction=get_function)
    assert driver.function(code_object, 0, "kernel", 0).value == 0x1001
    assert driver.function(code_object, 0, "other", 0).value == 0x1001  # one load per module
    gc.collect()
    [pointer] = images
    held = [obj for cache in vars(driver).values() if isinstance(cache, dict) for obj in cache.values()
            if isinstance(obj, ctypes.Array) and ctypes.addressof(obj) == pointer]
    assert len(held) == 1 and bytes(held[0]) == code_object.read_bytes()


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


def test_isa_identical_targets_do_not_fall_back(gfx1030_only, monkeypatch):
    """HIP runs a code object only on a GPU that reports the exact ISA it names: a gfx1034 does not run
    gfx1030's kernels unless HSA_OVERRIDE_GFX_VERSION makes it report gfx1030. The error says both ways."""
    data = json.loads((gfx1030_only / "gfx1030" / "dispatch.json").read_text())
    assert data["isa_targets"] == ["gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035", "gfx1036"]
    assert dispatch.table_for("gfx1030").target == "gfx1030"
    for target in data["isa_targets"][1:]:
        assert dispatch.fallback_chain(target) == []
        assert dispatch.same_isa_tables(target) == [gfx1030_only / "gfx1030" / "dispatch.json"]
        with pytest.raises(KernelsNotBuiltError) as err:
            dispatch.table_for(target, "AMD Radeon RX 6500 XT")
        assert str(err.value).endswith(
            f"build them with: rdnattention-gen build --targets {target}; or run gfx1030's kernels (the same "
            "instruction set) by making the GPU report gfx1030: HSA_OVERRIDE_GFX_VERSION=10.3.0 (HIP loads a code "
            "object only on a GPU that reports the exact ISA it was built for)")
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "10.3.0")
    assert hip.target(torch.device("cuda", 0)) == "gfx1030"


@pytest.mark.parametrize("target, value", [("gfx1030", "10.3.0"), ("gfx1034", "10.3.4"), ("gfx906", "9.0.6"),
                                           ("gfx90c", "9.0.12"), ("gfx1100", "11.0.0")])
def test_the_override_named_in_the_error_is_the_one_rocm_reads(target, value):
    assert dispatch.hsa_override_value(target) == value
    assert hip.override_arch(value) == target


def test_an_unknown_gpu_names_itself_the_built_targets_and_the_command(gfx1030_only):
    with pytest.raises(KernelsNotBuiltError) as err:
        dispatch.table_for("gfx1100", "AMD Radeon RX 7900 XTX")
    msg = str(err.value)
    assert msg.startswith("no kernels built for AMD Radeon RX 7900 XTX (gfx1100)")
    assert "built targets there: gfx1030" in msg and msg.endswith("rdnattention-gen build --targets gfx1100")
