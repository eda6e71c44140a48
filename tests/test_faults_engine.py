"""A bad engine at start, with real parts and the unit's restart settings: a corrupted ONNX engine
file is rebuilt from the checkpoint (torch is the builder; the tests have it); without a rebuild
(``model.rebuild_engines: false``, or an engine directory on a read-only tmpfs) the daemon runs
the next backend with a loud warning and health ``engine_fallback``; a stale engine (its limits
no longer those of the config) is rebuilt; when nothing can run (a corrupted checkpoint) it exits
with one line and a status the systemd unit's ``RestartPreventExitStatus=`` covers, so systemd
does not restart it in a loop. A read-only cache directory is logged and the box runs without it."""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.fixtures_model import ONNX_LIMITS
from tests.fixtures_service import launch_daemon, service_config

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "chattts-appliance.service"


def no_restart_statuses() -> set[int]:
    """The exit statuses the unit's ``RestartPreventExitStatus=`` lists."""
    got = re.findall(r"^RestartPreventExitStatus=(.*)$", UNIT.read_text(), re.M)
    return {int(x) for line in got for x in line.split() if x.isdigit()}


def corrupt_onnx(engine_dir: Path) -> Path:
    """Flip one byte in the middle of the largest file of the ONNX export (its size, name and
    manifest unchanged); returns the file."""
    f = max((p for p in (engine_dir / "onnx").rglob("*") if p.is_file() and p.name != "manifest.json"),
            key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))
    return f


def _cfg(tiny_ckpt, tmp, engine_dir, **model):
    return service_config(tiny_ckpt, tmp, model={"backend": "onnxruntime", "engine_dir": str(engine_dir),
                                                 **ONNX_LIMITS, **model})


def _speaks(d) -> None:
    evs = d.request({"type": "speak", "text": "你好", "seed": 1, "id": "ok", "params": {"min_new_tokens": 5, "max_new_tokens": 5}})
    assert evs[-1]["type"] == "done", evs


def test_a_corrupted_engine_file_is_rebuilt_at_start(tiny_ckpt, onnx_dir, tmp_path):
    eng = tmp_path / "engines"
    shutil.copytree(onnx_dir, eng)
    bad = corrupt_onnx(eng)
    d = launch_daemon(tmp_path / "d", _cfg(tiny_ckpt, tmp_path, eng), timeout_s=300)
    try:
        (st,) = d.request({"type": "status"})
        assert st["backend"].startswith("onnxruntime") and st["health"] == "healthy", st
        _speaks(d)
    finally:
        assert d.stop() == 0, d.log()[-3000:]
    log = d.log()
    assert "the onnxruntime engine cannot be used" in log and bad.name in log and "rebuilt the onnxruntime engine" in log


def test_a_stale_engine_is_rebuilt_with_the_configs_limits(tiny_ckpt, onnx_dir, tmp_path):
    eng = tmp_path / "engines"
    shutil.copytree(onnx_dir, eng)
    d = launch_daemon(tmp_path / "d", _cfg(tiny_ckpt, tmp_path, eng, max_seq_len=1024), timeout_s=300)
    try:
        _speaks(d)
    finally:
        assert d.stop() == 0, d.log()[-3000:]
    assert "limits.max_seq_len is 512, expected 1024" in d.log() and "rebuilt the onnxruntime engine" in d.log()


def test_without_a_rebuild_the_next_backend_runs_and_health_says_so(tiny_ckpt, onnx_dir, tmp_path):
    eng = tmp_path / "engines"
    shutil.copytree(onnx_dir, eng)
    corrupt_onnx(eng)
    d = launch_daemon(tmp_path / "d", _cfg(tiny_ckpt, tmp_path, eng, rebuild_engines=False))
    try:
        (st,) = d.request({"type": "status"})
        assert st["backend"] == "torch-cpu" and st["health"] == "degraded", st
        (cond,) = st["conditions"]
        assert cond["name"] == "engine_fallback" and "onnxruntime engine cannot be used" in cond["reason"], cond
        assert "sha256" in cond["reason"] and "running torch instead" in cond["reason"], cond
        _speaks(d)
    finally:
        assert d.stop() == 0, d.log()[-3000:]
    assert "ENGINE FALLBACK" in d.log()


@pytest.fixture
def read_only_fs(tmp_path):
    """``(path, seal)``: a small tmpfs to fill, then ``seal()`` remounts it read-only (root only)."""
    d = tmp_path / "ro"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", f"ro-{uuid.uuid4().hex[:6]}", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield d, lambda: subprocess.run(["mount", "-o", "remount,ro", str(d)], check=True)
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_read_only_engine_and_cache_directory_fall_back_instead_of_failing(tiny_ckpt, onnx_dir, tmp_path, read_only_fs):
    ro, seal = read_only_fs
    shutil.copytree(onnx_dir, ro / "engines")
    corrupt_onnx(ro / "engines")
    (ro / "cache").mkdir()
    seal()
    cfg = _cfg(tiny_ckpt, tmp_path, ro / "engines")
    cfg["safety"] = {"cache_dir": str(ro / "cache")}
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        (st,) = d.request({"type": "status"})
        assert st["backend"] == "torch-cpu" and [c["name"] for c in st["conditions"]] == ["engine_fallback"], st
        _speaks(d)
    finally:
        assert d.stop() == 0, d.log()[-3000:]
    log = d.log()
    assert "rebuilding the onnxruntime engine failed" in log and "Read-only file system" in log
    assert "safety.cache_dir" in log and "running without a cache" in log


def test_nothing_can_run_exits_once_with_a_status_systemd_does_not_restart(tmp_path):
    from appliance.build.random_ckpt import write_random_checkpoint
    from tests.test_integrity import corrupt_behind_header

    root = tmp_path / "ck"
    write_random_checkpoint(root, "tiny", seed=0)
    corrupt_behind_header(root / "asset" / "gpt" / "model.safetensors")
    d = launch_daemon(tmp_path / "d", service_config(root, tmp_path), wait=False)
    rc = d.proc.wait(120)
    assert rc in no_restart_statuses(), (rc, no_restart_statuses(), d.log()[-2000:])
    errors = [line for line in d.log().splitlines() if "serve: error:" in line]
    assert len(errors) == 1 and "gpt/model.safetensors" in errors[0], d.log()[-2000:]
    assert "Traceback" not in d.log()
    if shutil.which("systemd-analyze"):
        r = subprocess.run(["systemd-analyze", "verify", str(UNIT)], capture_output=True, text=True)
        assert "RestartPreventExitStatus" not in r.stderr, r.stderr


def unit_setting(key: str) -> str:
    """The value of ``key=`` in the unit's file (the last one wins, as in systemd)."""
    return re.findall(rf"^{key}=(.*)$", UNIT.read_text(), re.M)[-1].strip()


def test_a_read_only_cache_directory_starts_ready_and_leaves_nothing_to_restart(tiny_ckpt, tmp_path, read_only_fs,
                                                                                 notify_socket):
    """Under the unit's settings: systemd hands the daemon its cache directory (``CacheDirectory=``,
    ``$CACHE_DIRECTORY``), here on a read-only tmpfs; ``Type=notify``: the start succeeded once
    ``READY=1`` arrives; ``Restart=on-failure``. The daemon logs that it runs without a cache,
    sends ``READY=1``, is healthy (nothing it needs to speak is missing), speaks, and exits 0 at
    SIGTERM: no failure for systemd to restart."""
    assert unit_setting("Type") == "notify" and unit_setting("Restart") == "on-failure"
    ro, seal = read_only_fs
    (ro / "cache").mkdir()
    seal()
    cfg = service_config(tiny_ckpt, tmp_path, safety={"cache_dir": str(ro / "cache")})
    d = launch_daemon(tmp_path / "d", cfg, env={"CACHE_DIRECTORY": str(ro / "cache")})
    try:
        notify_socket.wait_for("READY", timeout=120)
        (st,) = d.request({"type": "status"})
        assert st["health"] == "healthy" and st["conditions"] == [], st
        _speaks(d)
    finally:
        rc = d.stop()
    assert rc == 0, d.log()[-3000:]
    log = d.log()
    assert "safety.cache_dir: directory" in log and "is on a read-only file system" in log
    assert "the box starts anyway: running without a cache" in log
