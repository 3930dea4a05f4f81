import os
import sys
from pathlib import Path

import pytest

from rdnattention_gen import build
from rdnattention_gen.matrix import load_matrix

REPO_ROOT = Path(__file__).resolve().parent.parent

# The tests sit in one folder per layer (generator/, runtime/, kernels/ on the host emulator, gpu/);
# the helpers they share (cases.py, amd_emulator.py, tiny_amdgcn.py) sit here, beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))


# RDNATTENTION_TEST_INSTALLED=1: test an installed (non-editable) rdnattention from a copy of these
# tests outside any checkout (scripts/test_install.sh); kernels come from the install's search path
# and the host targets are built into the per-user kernel directory.
INSTALLED = os.environ.get("RDNATTENTION_TEST_INSTALLED") == "1"


def pytest_configure(config):
    # The tests of one checkout must test its own code: an editable install of another checkout
    # would otherwise be imported silently (plain `pytest` does not put the checkout on sys.path).
    import rdnattention
    import rdnattention_gen

    for module in (rdnattention, rdnattention_gen):
        where = Path(module.__file__).resolve().parent.parent
        if INSTALLED:
            if where == REPO_ROOT or (where / "pyproject.toml").is_file():
                raise pytest.UsageError(f"RDNATTENTION_TEST_INSTALLED=1 but {module.__name__} comes from the "
                                        f"source tree {where}, not from an installed wheel")
        elif where != REPO_ROOT:
            raise pytest.UsageError(f"these tests are {REPO_ROOT}'s but import {module.__name__} from {where}; "
                                    f"run `python -m pytest` in {REPO_ROOT} or reinstall it with pip install -e")


def _build_dir() -> Path:
    if os.environ.get("RDNATTENTION_BUILD_DIR"):
        return Path(os.environ["RDNATTENTION_BUILD_DIR"])
    if INSTALLED:
        from rdnattention.dispatch import user_kernel_dir
        return user_kernel_dir()
    return REPO_ROOT / "build"


BUILD_DIR = _build_dir()


def pytest_addoption(parser):
    parser.addoption("--update-goldens", action="store_true", help="rewrite tests/generator/golden from the templates")


# RDNATTENTION_TEST_HEAD_DIMS=64,128: the host targets of the matrix the tests build and read narrowed to
# these head_dims (Matrix.narrowed), as `rdnattention-gen build --head-dims` builds them
# (scripts/test_install.sh: the install's tests, on a build of a part of the host emulator's compile).
HEAD_DIMS = tuple(int(h) for h in os.environ.get("RDNATTENTION_TEST_HEAD_DIMS", "").split(",") if h.strip())


@pytest.fixture(scope="session")
def matrix():
    m = load_matrix()
    return m.narrowed(HEAD_DIMS, ("host", "host_f32")) if HEAD_DIMS else m


@pytest.fixture(scope="session")
def build_dir():
    return BUILD_DIR


@pytest.fixture(scope="session")
def host_build(matrix):
    """The host targets built (incrementally) into the build directory the runtime reads."""
    build.build(matrix, matrix.select("host,host_f32"), BUILD_DIR, log=lambda *_: None)
    return BUILD_DIR


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="session")
def default_audit(matrix):
    """Audit rows of the default targets, built incrementally."""
    return build.build(matrix, matrix.select("default"), BUILD_DIR, log=lambda *_: None)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The devices the client tests run on: the host emulator (its kernels built) and, marked gpu,
    an NVIDIA GPU."""
    import torch
    if request.param == "cuda":
        if not torch.cuda.is_available() or torch.version.hip is not None:
            pytest.skip("needs an NVIDIA GPU")
    else:
        request.getfixturevalue("host_build")
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _replays_of_this_test_alone(monkeypatch):
    """Each test starts with the runtime's replay state as a new process has it (cases.fresh_replays)
    and no express function standing at any entry point (each one's replay.LastExpress), so that
    what one test leaves behind (a cache it followed, an express of its geometry) never serves or
    shapes another's calls. Nothing to reset before the runtime is imported."""
    if "rdnattention.replay" not in sys.modules:
        yield
        return
    from cases import fresh_replays
    from rdnattention import api, kvcache, replay, varlen
    from rdnattention.integrations import sdpa, transformers
    fresh_replays(monkeypatch)
    for module, name in ((api, "_flash_express"), (api, "_func_express"), (api, "_sdpa_express"),
                         (sdpa, "_express"), (transformers, "_express"), (kvcache, "_express")):
        monkeypatch.setattr(module, name, replay.LastExpress(getattr(module, name).roles))
    monkeypatch.setattr(varlen, "_EXPRESS", {e: replay.LastExpress(x.roles) for e, x in varlen._EXPRESS.items()})
    yield


@pytest.fixture
def sdpa_restored():
    """After the test, torch's SDPA is unpatched and the very object the test started with."""
    import torch.nn.functional as F
    import rdnattention
    original = F.scaled_dot_product_attention
    yield
    rdnattention.unpatch_sdpa()
    assert F.scaled_dot_product_attention is original


@pytest.fixture
def stale_decode_output(monkeypatch):
    """decode.allocate's outputs hold NaNs, as stale memory may: rows a kernel leaves unwritten show."""
    from rdnattention import decode
    real = decode.allocate

    def stale(*a, **kw):
        out, lse = real(*a, **kw)
        out.fill_(float("nan"))
        return out, lse

    monkeypatch.setattr(decode, "allocate", stale)
