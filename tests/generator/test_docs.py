"""docs/hardware.md is generated; it must match what the matrix and the audit say now."""

import subprocess
import sys

import pytest
from conftest import REPO_ROOT


@pytest.mark.slow  # builds every GPU target (about 7 minutes on 2 cores)
def test_hardware_md_is_up_to_date(build_dir):
    out = subprocess.run([sys.executable, "-m", "rdnattention_gen.cli", "docs", "--check",
                          "--build-dir", str(build_dir)], capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr
