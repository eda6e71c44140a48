"""scripts/arm64_emulated.sh: its command line only (the run itself is slow and changes the
machine: apt, debootstrap, mounts; see docs/jetson.md). A bad option or a system directory as
the root stops it with exit 2 before it writes anything; shellcheck covers the rest
(tests/test_ops_install.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "arm64_emulated.sh"


def _run(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_help_describes_the_steps():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    for needle in ("install_jetson.sh", "--prefix", "debootstrap", "onnxruntime", "--qemu-cpu", "--fresh",
                   "arm64_emulated.jsonl"):
        assert needle in r.stdout, needle


@pytest.mark.parametrize("args, msg", [(["--bogus"], "unknown option '--bogus'"), (["--root"], "--root needs a directory"),
                                       (["--root", "/etc"], "choose a directory of its own"),
                                       (["--root", "/"], "choose a directory of its own")])
def test_bad_command_line_changes_nothing(tmp_path, args, msg):
    results = tmp_path / "results"
    r = _run(*args, "--results", str(results)) if args[-1] != "--root" else _run(*args)
    assert r.returncode == 2 and msg in r.stderr, r.stdout + r.stderr
    assert not results.exists()
