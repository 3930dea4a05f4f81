"""`rdnattention doctor`: which devices it checks, its exit status, and that the fixes it prints
are commands the tools accept as printed."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch

from rdnattention import cli, dispatch
from rdnattention.errors import IncompatibleKernelsError, KernelsNotBuiltError
from rdnattention_gen import cli as gen_cli


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_without_host_kernels_the_cpu_is_skipped_and_nothing_checked_is_a_failure(monkeypatch, no_gpu, capsys):
    monkeypatch.setattr(dispatch, "built_tables", lambda: [Path("/x/sm_90/dispatch.json")])
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "skip  cpu" in out and "rdnattention doctor --cpu" in out
    assert "nothing checked" in out


def test_installed_host_kernels_make_the_cpu_count(host_build, no_gpu, capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "ok    cpu" in out and "every device works" in out


def test_the_cpu_can_be_left_out_where_host_kernels_exist(host_build, no_gpu, capsys):
    assert cli.main(["doctor", "--no-cpu"]) == 1
    assert "nothing checked" in capsys.readouterr().out


def test_a_failing_device_exits_1_with_a_fix(monkeypatch, no_gpu, capsys):
    def missing(*args, **kwargs):
        raise KernelsNotBuiltError("no kernels built for target 'host'")

    monkeypatch.setattr("rdnattention.api.flash_attn", missing)
    assert cli.main(["doctor", "--cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  cpu" in out and "fix: build the host emulator's kernels" in out


@pytest.mark.parametrize("error, target", [(KernelsNotBuiltError("x"), "host"), (KernelsNotBuiltError("x"), "gfx1030"),
                                            (IncompatibleKernelsError("x"), "gfx906")])
def test_every_printed_build_command_parses_as_printed(error, target):
    fix = cli._fix(error, target)
    assert "pip install 'rdnattention[gen]'" in fix
    command = fix.split(", then ", 1)[1].split(";", 1)[0]
    words = shlex.split(command)
    assert words[:2] == ["rdnattention-gen", "build"]
    args = gen_cli.parser().parse_args(words[1:])
    assert args.user and args.targets == target
