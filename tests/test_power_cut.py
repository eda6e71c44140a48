"""Files a power cut tore: an engine manifest and a calibration record found empty or NUL-filled
at start (what a lost page cache leaves of a file written without fsync) are taken as missing,
with one warning naming them: the daemon rebuilds or recalibrates and serves, it never exits.
The real daemon on the tiny checkpoint."""

from __future__ import annotations

import shutil

from tests.fixtures_model import ONNX_LIMITS
from tests.fixtures_service import service_config


def _speaks(d) -> None:
    evs = d.request({"type": "speak", "text": "你好", "seed": 1, "id": "ok", "params": {"min_new_tokens": 5, "max_new_tokens": 5}})
    assert evs[-1]["type"] == "done", evs


def test_a_nul_filled_engine_manifest_is_rebuilt_and_the_daemon_serves(tiny_ckpt, onnx_dir, tmp_path, start_daemon):
    eng = tmp_path / "engines"
    shutil.copytree(onnx_dir, eng)
    (man,) = (eng / "onnx").rglob("manifest.json")
    man.write_bytes(b"\0" * man.stat().st_size)
    cfg = service_config(tiny_ckpt, tmp_path, model={"backend": "onnxruntime", "engine_dir": str(eng), **ONNX_LIMITS})
    d = start_daemon(cfg, timeout_s=300)
    (st,) = d.request({"type": "status"})
    assert st["backend"].startswith("onnxruntime") and st["health"] == "healthy", st
    _speaks(d)
    log = d.log()
    assert log.count(f"engine manifest {man} is all NUL bytes") == 1, log[-3000:]
    assert "rebuilt the onnxruntime engine" in log
    assert man.read_bytes().startswith(b"{")


def test_a_nul_filled_calibration_record_is_measured_again(tiny_ckpt, tmp_path, start_daemon):
    eng = tmp_path / "eng"
    eng.mkdir()
    (eng / "calibration.json").write_bytes(b"\0" * 8192)
    cfg = service_config(tiny_ckpt, tmp_path, model={"engine_dir": str(eng)}, stream={"calibrate_at_start": True})
    d = start_daemon(cfg, timeout_s=300)
    _speaks(d)
    log = d.log()
    assert log.count("calibration record") >= 1 and "is all NUL bytes" in log, log[-3000:]
    assert b"\0" not in (eng / "calibration.json").read_bytes()
