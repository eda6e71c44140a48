"""scripts/install_jetson.sh: shellcheck, the documented exit codes (not a Jetson, unsupported
JetPack, bad options), the dry-run plan on a fake Jetson tree, and the non-Jetson parts (venv,
package install from this repo, config, units) for real under --prefix, twice (idempotent)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "install_jetson.sh"
EXIT_NOT_JETSON, EXIT_UNSUPPORTED, EXIT_USAGE = 3, 4, 2
IS_JETSON = Path("/etc/nv_tegra_release").exists()


def _run(*args, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def _fake_jetson(root: Path, release: str, model: str = "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super") -> str:
    (root / "etc").mkdir(parents=True)
    (root / "etc/nv_tegra_release").write_text(release + "\n")
    (root / "proc/device-tree").mkdir(parents=True)
    (root / "proc/device-tree/model").write_bytes(model.encode() + b"\0")
    return str(root)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    steps = sorted((SCRIPT.parent / "jetson").glob("*.sh"))   # the steps it sources, followed (-x) and alone
    r = subprocess.run(["shellcheck", "-x", "--severity=style", str(SCRIPT), *map(str, steps)], capture_output=True,
                       text=True, timeout=60, cwd=str(SCRIPT.parent))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(IS_JETSON, reason="this machine is a Jetson")
def test_dry_run_here_prints_the_plan_and_says_not_a_jetson():
    before = os.path.exists("/opt/chattts-appliance"), os.path.exists("/etc/chattts-appliance")
    r = _run("--dry-run")
    assert r.returncode == EXIT_NOT_JETSON, r.stderr
    out = r.stdout
    assert "not a Jetson" in out and "dry run: nothing is changed" in out
    for needle in ("==> apt packages", "useradd --system", "-m venv --system-site-packages /opt/chattts-appliance/venv",
                   "-m pip install", "/etc/chattts-appliance/config.yaml", "/etc/systemd/system/chattts-appliance.service",
                   "model fetch", "engines build --config /etc/chattts-appliance/config.yaml --precision fp16",
                   "engines compile --config /etc/chattts-appliance/config.yaml", "health --config", "systemctl enable --now chattts-appliance.service chattts-appliance-health.timer",
                   f"(exit {EXIT_NOT_JETSON})", "skipped (JetPack only, not a Jetson): python3-libnvinfer",
                   "skipped (JetPack only, not a Jetson): the [jetson] extra", "JetPack-only steps skipped (not a Jetson)"):
        assert needle in out, needle
    assert "[jetson]" not in out.split("==> python package from")[1].splitlines()[0]
    assert (os.path.exists("/opt/chattts-appliance"), os.path.exists("/etc/chattts-appliance")) == before


@pytest.mark.skipif(IS_JETSON, reason="this machine is a Jetson")
def test_real_install_refuses_off_jetson():
    r = _run()
    assert r.returncode == EXIT_NOT_JETSON
    assert "not a Jetson" in r.stderr and "--prefix" in r.stderr
    assert "\n+ " not in r.stdout                                     # nothing was run


def test_dry_run_on_a_jetpack6_board(tmp_path):
    root = _fake_jetson(tmp_path, "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025")
    r = _run("--dry-run", "--probe-root", root, "--precision", "int8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Jetson: NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super, L4T R36.4.3 (JetPack 6.2)" in r.stdout
    assert "not a Jetson" not in r.stdout and "JetPack only" not in r.stdout
    assert "python3-libnvinfer" in r.stdout
    assert f"pip install --disable-pip-version-check {REPO}\\[jetson\\]" in r.stdout
    assert "engines build --config /etc/chattts-appliance/config.yaml --precision int8" in r.stdout
    # the look-ahead measured at install where none is recorded, not at the daemon's first start
    assert "calibrate --config /etc/chattts-appliance/config.yaml --if-missing" in r.stdout
    assert "==> the path this box will run" in r.stdout and "torch" not in r.stdout.split("pip install")[1].split()[0]
    assert "==> done" in r.stdout
    e = _run("--dry-run", "--probe-root", root, "--export-on-board")   # torch only when asked to export here
    assert e.returncode == 0 and f"{REPO}\\[jetson\\,torch\\]" in e.stdout, e.stdout + e.stderr
    if "-DGGML_CUDA=on" in r.stdout:     # nvcc present: the CUDA variant, with the pool an Orin Nano needs
        assert "-DGGML_CUDA_NO_VMM=ON" in r.stdout


def test_dry_run_with_onnx_graphs_from_elsewhere(tmp_path):
    root = _fake_jetson(tmp_path / "root", "# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64")
    graphs = tmp_path / "engines" / "onnx" / "fp16"
    graphs.mkdir(parents=True)
    (graphs / "manifest.json").write_text("{}")
    r = _run("--dry-run", "--probe-root", root, "--onnx-dir", str(tmp_path / "engines"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(JetPack 6.0)" in r.stdout
    stage = "/var/cache/chattts-appliance/engines/onnx/.fp16.incoming"      # beside it, then renamed
    assert f"+ cp -a {graphs}/. {stage}/" in r.stdout
    assert f"+ mv -f {stage}/* /var/cache/chattts-appliance/engines/onnx/fp16/" in r.stdout
    assert "engines export" not in r.stdout and "engines build" in r.stdout
    bad = _run("--dry-run", "--probe-root", root, "--onnx-dir", str(tmp_path / "root"))
    assert bad.returncode == EXIT_USAGE and "no manifest.json" in bad.stderr


def test_onnx_graphs_from_elsewhere_replace_each_file_by_a_rename(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "engines" / "onnx" / "fp16"
    for d, tag in ((src, "new"), (dest, "old")):
        d.mkdir(parents=True)
        (d / "gpt.onnx").write_text(tag * 1000)
        (d / "manifest.json").write_text(tag)
    (src / "vocos.onnx").write_text("vocos")
    held, ino = open(dest / "gpt.onnx"), (dest / "gpt.onnx").stat().st_ino     # the daemon reading it
    script = ('set -euo pipefail; DRY_RUN=0; EXIT_FAIL=1; run() { "$@"; }; die() { exit 1; }; '
              f'. {REPO}/scripts/jetson/engines.sh; replace_files "$1" "$2"')
    r = subprocess.run(["bash", "-c", script, "sh", str(src), str(dest)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert {f.name: f.read_text() for f in dest.iterdir()} == \
        {"gpt.onnx": "new" * 1000, "manifest.json": "new", "vocos.onnx": "vocos"}
    assert (dest / "gpt.onnx").stat().st_ino != ino and held.read() == "old" * 1000     # renamed over, not rewritten
    held.close()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["fp16"]                    # no staging left


@pytest.mark.parametrize("release, words", [
    ("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64", ["JetPack 5.1.2", "Python 3.8", "JetPack 6"]),
    ("# R32 (release), REVISION: 7.4, GCID: 33514132, BOARD: t210ref, EABI: aarch64", ["L4T R32.7.4", "not supported"]),
    ("garbage", ["cannot read the L4T release"]),
])
def test_unsupported_jetpack_fails_early(tmp_path, release, words):
    r = _run("--dry-run", "--probe-root", _fake_jetson(tmp_path, release))
    assert r.returncode == EXIT_UNSUPPORTED, r.stdout + r.stderr
    for w in words:
        assert w in r.stderr
    assert "==> apt packages" not in r.stdout                          # before any step


@pytest.mark.parametrize("args, msg", [(["--precision", "fp8"], "no FP8"), (["--bogus"], "unknown option"),
                                       (["--prefix"], "needs a directory")])
def test_bad_options(args, msg):
    r = _run(*args)
    assert r.returncode == EXIT_USAGE and msg in r.stderr


def _python_with_yaml():
    for py in ("/usr/bin/python3", shutil.which("python3")):
        if py and subprocess.run([py, "-c", "import sys, yaml, venv; sys.exit(sys.version_info < (3, 10))"],
                                 capture_output=True).returncode == 0:
            return py
    return None


@pytest.fixture(scope="module")
def prefix_install(tmp_path_factory):
    py = _python_with_yaml()
    if py is None:
        pytest.skip("no system python3 >= 3.10 with PyYAML for a --system-site-packages venv")
    prefix = tmp_path_factory.mktemp("prefix")
    first = _run("--prefix", str(prefix), "--python", py, "--pip-no-deps", timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    return prefix, py, first


def test_prefix_install_is_real(prefix_install):
    prefix, _, first = prefix_install
    cli = prefix / "opt/chattts-appliance/venv/bin/chattts-appliance"
    assert cli.is_file() and os.access(cli, os.X_OK)
    r = subprocess.run([str(cli), "health", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--socket" in r.stdout
    cfg_path = prefix / "etc/chattts-appliance/config.yaml"
    from appliance.config import load_config

    cfg = load_config(cfg_path)
    assert cfg.resolve(cfg.model.path) == prefix / "var/lib/chattts-appliance/models/chattts"
    assert cfg.resolve(cfg.model.engine_dir) == prefix / "var/cache/chattts-appliance/engines"
    assert cfg.resolve(cfg.service.spool_dir) == prefix / "var/lib/chattts-appliance/spool"
    assert "skipped apt, service user, checkpoint, engines, health check and systemctl" in first.stdout
    if not IS_JETSON:   # the JetPack-only parts say they were skipped, and what runs instead
        assert "JetPack-only steps skipped (not a Jetson): python3-libnvinfer" in first.stdout
        assert "model.backend auto picks onnxruntime" in first.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_installed_units_verify(prefix_install):
    prefix = prefix_install[0]
    units = sorted((prefix / "etc/systemd/system").iterdir())
    assert [u.name for u in units] == ["chattts-appliance-health.service", "chattts-appliance-health.timer",
                                       "chattts-appliance.service", "chattts-appliance.socket"]
    assert f"ExecStart={prefix}/opt/chattts-appliance/venv/bin/chattts-appliance serve --config {prefix}/etc/chattts-appliance/config.yaml" \
        in (prefix / "etc/systemd/system/chattts-appliance.service").read_text()
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, units)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


def test_rerun_is_idempotent_and_keeps_the_config(prefix_install):
    prefix, py, _ = prefix_install
    cfg_path = prefix / "etc/chattts-appliance/config.yaml"
    edited = cfg_path.read_text().replace("memory_budget_mb: 1500", "memory_budget_mb: 1200")
    cfg_path.write_text(edited)
    timer = prefix / "etc/systemd/system/chattts-appliance-health.timer"
    want = timer.read_text()
    timer.write_text(want + "# changed by hand\n")
    held, ino = open(timer), timer.stat().st_ino              # systemd reading it meanwhile
    r = _run("--prefix", str(prefix), "--python", py, "--pip-no-deps", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("unchanged: chattts-appliance") == 3
    # the changed unit replaced by a rename: a new file, the open one whole and as it was
    assert timer.read_text() == want and timer.stat().st_ino != ino
    assert held.read().endswith("# changed by hand\n")
    held.close()
    assert not list(timer.parent.glob(".*.new"))
    assert "keeping the existing config" in r.stdout and "config validates" in r.stdout
    assert "+ " + py + " -m venv" not in r.stdout and "mkdir" not in r.stdout
    assert cfg_path.read_text() == edited


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
@pytest.mark.parametrize("script", sorted((Path(__file__).resolve().parents[1]).glob("*/*.sh")), ids=lambda p: p.name)
def test_every_shell_script_is_shellcheck_clean(script):
    r = subprocess.run(["shellcheck", "-x", "--severity=style", str(script)], capture_output=True, text=True,
                       timeout=60, cwd=script.parents[1])
    assert r.returncode == 0, r.stdout
