"""A box whose engines have no look-ahead calibration measures it at its first start, before it
serves (``stream.calibrate_at_start``), records it beside the engines with the health check's
reference, and streams with it; the next start reads the record and calibrates nothing.
The real daemon on the tiny checkpoint (torch CPU)."""

from __future__ import annotations

import json

from tests.fixtures_service import service_config


def test_a_fresh_box_calibrates_once_before_it_serves(tiny_ckpt, tmp_path, start_daemon):
    eng = tmp_path / "eng"
    cfg = service_config(tiny_ckpt, tmp_path, model={"engine_dir": str(eng)}, stream={"calibrate_at_start": True})
    d = start_daemon(cfg, name="first", timeout_s=300.0)
    assert d.stop() == 0
    log = d.log_path.read_text()
    assert "calibrating the look-ahead" in log or "calibration took" in log, log[-3000:]
    (entry,) = json.loads((eng / "calibration.json").read_text())["entries"]
    assert entry["backend"] == "torch-cpu" and entry["reference"] and 1 <= entry["lookahead_tokens"] <= entry["exact_lookahead"]
    assert f"look-ahead {entry['lookahead_tokens']} steps (calibrated" in log or entry["lookahead_tokens"] == entry["exact_lookahead"]
    again = start_daemon(cfg, name="second")
    assert again.stop() == 0
    log2 = again.log_path.read_text()
    assert "calibration took" not in log2 and f"look-ahead: {entry['lookahead_tokens']} steps (calibrated" in log2, log2[-3000:]
