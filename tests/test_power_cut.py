"""Files a power cut tore, and a disk that fills: an engine manifest and a calibration record found
empty or NUL-filled at start (what a lost page cache leaves of a file written without fsync) are
taken as missing, with one warning naming them: the daemon rebuilds or recalibrates and serves,
it never exits; a journal with a NUL tail is set aside and accounted; a full 1 MiB tmpfs spool is
named by health until the filler goes. The real daemon on the tiny checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest

from tests.fixtures_model import ONNX_LIMITS
from tests.fixtures_service import service_config
from tests.waits import wait_for, wait_log


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


def test_a_journal_with_a_nul_tail_is_set_aside_and_its_intact_requests_spoken_once(tiny_ckpt, tmp_path, start_daemon):
    """What a power cut leaves of a journal whose last blocks never reached the disk: its tail is
    NUL bytes. The daemon starts, sets the file aside (kept), says where the damage begins and how
    much was lost, speaks each intact unfinished request once, and health says ``journal_recovered``
    until the journal is next compacted cleanly (tests/test_journal.py: the clearing)."""
    from appliance.service.journal import FILE, Journal

    spool = tmp_path / "d" / "spool"
    j = Journal(spool)
    j.open()
    for i in range(4):
        j.accept({"type": "speak", "id": f"p{i}", "text": "你好。", "channel": "main", "seed": i, "priority": "normal",
                  "params": {"min_new_tokens": 5, "max_new_tokens": 5}})
    j.close()
    data = (spool / FILE).read_bytes()
    at = data.rindex(b"\n", 0, len(data) - 1) + 1            # the last record (p3) was lost
    (spool / FILE).write_bytes(data[:at] + b"\0" * (len(data) - at))
    d = start_daemon(service_config(tiny_ckpt, tmp_path), timeout_s=300)
    for i in range(3):
        wait_log(d.log, f"replayed request p{i}: done", 120, alive=d.alive)
    log = d.log()
    assert f"is damaged at byte {at}: a cut or unreadable end; 3 record(s) recovered, {len(data) - at} byte(s) " \
           f"could not be read; set aside as {spool / FILE}.1.corrupt" in log, log[-3000:]
    assert (spool / f"{FILE}.1.corrupt").read_bytes()[at:] == b"\0" * (len(data) - at)
    assert all(log.count(f"started p{i} on") == 1 for i in range(3)) and "p3" not in log.split("ready:")[-1]
    (st,) = d.request({"type": "status"})
    (c,) = [c for c in st["conditions"] if c["name"] == "journal_recovered"]
    assert st["health"] == "degraded" and f"damaged at byte {at}" in c["reason"] and "3 record(s) recovered" in c["reason"], st


@pytest.fixture
def spool_fs(tmp_path):
    """A real 1 MiB tmpfs for the spool (root only; skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    d = tmp_path / "fs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", f"sp-{uuid.uuid4().hex[:6]}", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_full_spool_is_named_by_health_until_the_filler_goes(tiny_ckpt, tmp_path, spool_fs, start_daemon):
    """``storage_degraded`` holds while the spool's file system cannot take the next record, not
    only until a compaction manages to write a small file; it clears once space returns."""
    d = start_daemon(service_config(tiny_ckpt, tmp_path, service={"spool_dir": str(spool_fs / "spool")}))
    _speaks(d)                                                # the journal has been written (and compacted)

    def storage(d) -> str:
        (st,) = d.request({"type": "status"})
        return next((c["reason"] for c in st["conditions"] if c["name"] == "storage_degraded"), "")

    assert storage(d) == ""
    st = os.statvfs(spool_fs)
    subprocess.run(["fallocate", "-l", str(st.f_bavail * st.f_frsize), str(spool_fs / "filler")], check=True)
    why = wait_for(lambda: storage(d), 30, "storage_degraded in status")
    assert "the disk is full" in why and str(spool_fs / "spool") in why, why
    _speaks(d)                                                # it still plays (not crash-safe)
    assert "disk is full" in storage(d)                       # and still says so: the disk is still full
    (spool_fs / "filler").unlink()
    wait_for(lambda: storage(d) == "", 30, "storage_degraded cleared once the filler is gone")
