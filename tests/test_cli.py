"""The `layershard` command itself: --version and --help list the subcommands."""

from __future__ import annotations

import subprocess
import sys

import layershard


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "layershard", *args], capture_output=True, text=True
    )


def test_version():
    out = _run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"layershard {layershard.__version__}"


def test_help_lists_subcommands():
    out = _run("--help")
    assert out.returncode == 0
    for sub in ("train", "checkpoint", "bench", "plan"):
        assert sub in out.stdout


def test_unknown_subcommand_fails():
    out = _run("frobnicate")
    assert out.returncode != 0 and "invalid choice" in out.stderr
