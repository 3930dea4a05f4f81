#!/usr/bin/env bash
# One-shot set-up on a fresh Debian 12 machine, then the main job:
#   toolchain (clang-22, lld-22) -> package -> build + audit the default targets and the host
#   emulator -> demo attention checked against the float64 oracle.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step's line says how long the set-up has run.
say() { echo "== [${SECONDS}s] $*"; }

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

if ! command -v clang-22 >/dev/null || ! command -v ld.lld-22 >/dev/null; then
  say "installing clang-22 and lld-22"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq clang-22 lld-22 llvm-22 >/dev/null
fi

# A HIP runtime that loads without an AMD GPU: the tests bind the HIP driver's symbols against it.
if ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q "libamdhip64.so"; then
  say "installing libamdhip64-5 (HIP runtime, for the HIP driver's tests)"
  $SUDO apt-get install -y -qq libamdhip64-5 >/dev/null || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libamdhip64-5 >/dev/null; }
fi

# ROCm 5.2's code object manager, which HIP asks for a code object's ISA before loading it: the build
# and the tests ask it about every AMD code object (it refuses code object v5, hence v4).
if ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q "libamd_comgr.so"; then
  say "installing libamd-comgr2 (ROCm's code object manager, for the check of the AMD code objects)"
  $SUDO apt-get install -y -qq libamd-comgr2 >/dev/null || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libamd-comgr2 >/dev/null; }
fi

# torch: an installed one is reused (a ROCm build included, even from the system site-packages);
# otherwise $TORCH_SPEC is installed, from $TORCH_INDEX_URL when set. ROCm users:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/rocm6.4 TORCH_SPEC=torch bash scripts/setup.sh
PYTHON="${PYTHON:-python3}"
if "$PYTHON" -c 'import os, sys, sysconfig
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)'; then
  # Debian's own Python refuses pip installs outside a virtual environment: use one, seeing the
  # system's torch when it has one.
  if [ ! -x .venv/bin/python ]; then
    SITE=""
    if "$PYTHON" -c "import torch" 2>/dev/null; then SITE="--system-site-packages"; fi
    say "creating .venv (the system Python is externally managed) ${SITE:+(seeing the system torch)}"
    "$PYTHON" -m venv $SITE .venv 2>/dev/null || { $SUDO apt-get install -y -qq python3-venv >/dev/null && "$PYTHON" -m venv $SITE .venv; }
  fi
  PYTHON=.venv/bin/python
fi
say "installing rdnattention (editable, with the generator's packages)"
"$PYTHON" -m pip install -q -e ".[gen]"

# One ninja run for the GPU targets and the host emulator: each target is one compile, so the host's
# shares the cores with the targets' instead of running alone after them. CI names more targets
# (RDNATTENTION_SETUP_TARGETS, .ci/run): all of them, built and audited once for every test after.
# The generator needs no torch: the build runs while torch and the test packages install.
# RDNATTENTION_SETUP_JOBS caps the parallel compiles (default: ninja's choice).
TARGETS="${RDNATTENTION_SETUP_TARGETS:-default,host}"
say "build + audit: $TARGETS (while torch and the test packages install)"
"$PYTHON" -m rdnattention_gen.cli build --targets "$TARGETS" ${RDNATTENTION_SETUP_JOBS:+-j "$RDNATTENTION_SETUP_JOBS"} &
BUILD=$!
trap 'kill "$BUILD" 2>/dev/null || true' EXIT  # a failed install stops the build too

if "$PYTHON" -c "import torch" 2>/dev/null; then
  say "using the installed torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
else
  say "installing torch (${TORCH_SPEC:=torch==2.13.0}${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL})"
  "$PYTHON" -m pip install -q "$TORCH_SPEC" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# The test extra's packages by name, read from pyproject.toml (Python 3.11's tomllib): installing
# ".[test]" would reinstall the editable package under the running build, so an older Python installs
# it after the build.
if mapfile -t TEST_PACKAGES < <("$PYTHON" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))' 2>/dev/null) \
    && [ ${#TEST_PACKAGES[@]} -gt 0 ]; then
  say "installing the test packages (pyproject.toml's test extra)"
  "$PYTHON" -m pip install -q "${TEST_PACKAGES[@]}"
  wait "$BUILD"  # its status: set -e stops here if the build failed
else
  wait "$BUILD"
  say "installing the test packages (rdnattention's test extra)"
  "$PYTHON" -m pip install -q -e ".[test]"
fi
trap - EXIT
say "demo on the host emulator"
"$PYTHON" -m rdnattention.demo
say "set-up done"
