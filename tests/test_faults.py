"""Injected faults with real parts, each bounded in time: a corrupted weight file (refused at
load; with the check off, NaN never reaches the sound device), a full disk under the journal and
the WAV directory (a real tmpfs filled with ``fallocate``: requests keep playing, not crash-safe,
and are never replayed twice; WAV output ends ``no_space``), and a synthesis that stalls (the
per-request watchdog ends it, the worker goes on). Elsewhere: sound devices that come and go
(tests/test_audio_devices.py, tests/test_channels_service.py), SIGKILL (tests/test_faults_crash.py),
the wall clock (tests/test_faults_clock.py), a bad engine (tests/test_faults_engine.py), the
broker (tests/test_faults_mqtt.py)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from tests.fixtures_service import ROOT, alsa_home, launch_daemon, service_config
from tests.test_integrity import corrupt_behind_header
from tests.waits import wait_for, wait_log


def _fails_to_start(tmp, cfg, **kw) -> str:
    d = launch_daemon(tmp, cfg, wait=False, **kw)
    try:
        rc = d.proc.wait(120)
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
    assert rc == 2, d.log()[-3000:]
    return d.log()


@pytest.fixture
def corrupt_ckpt(tmp_path):
    from appliance.build.random_ckpt import write_random_checkpoint

    root = tmp_path / "ck"
    write_random_checkpoint(root, "tiny", seed=0)
    corrupt_behind_header(root / "asset" / "gpt" / "model.safetensors")
    return root


def test_corrupted_weights_are_refused_at_start(corrupt_ckpt, tmp_path):
    log = _fails_to_start(tmp_path / "d", service_config(corrupt_ckpt, tmp_path))
    assert "failed its integrity check" in log and "gpt/model.safetensors: sha256" in log
    assert "Traceback" not in log


def test_with_the_check_off_nan_weights_end_in_engine_error_and_nothing_is_played(corrupt_ckpt, tmp_path):
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    cfg = service_config(corrupt_ckpt, tmp_path, audio={"output": "device"}, safety={"verify_checkpoint": False})
    d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
    try:
        evs = d.request({"type": "speak", "text": "你好", "seed": 1, "id": "nan-1"})
        assert [e["type"] for e in evs] == ["accepted", "started", "error"], evs
        assert evs[-1]["code"] == "engine_error" and "NaN/Inf" in evs[-1]["message"] and "GPT" in evs[-1]["message"]
        (st,) = d.request({"type": "status"})           # settled before its error was sent
        assert st["channels"]["main"]["active"] is None and st["state"] == "ready"
    finally:
        assert d.stop() == 0
    played = alsa.read()
    assert np.isfinite(played).all() and not np.any(played)      # only the idle stream's exact zeros
    assert "checkpoint integrity check is off" in d.log()


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB tmpfs for the journal (root only; skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    d = tmp_path / "fs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", f"jf-{uuid.uuid4().hex[:6]}", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def names(st: dict) -> set:
    """The names of the health conditions in a ``status`` or ``health`` reply."""
    return {c["name"] for c in st["conditions"]}


def reason(st: dict, name: str) -> str:
    """The reason of condition ``name`` in a ``status`` or ``health`` reply."""
    return next(c["reason"] for c in st["conditions"] if c["name"] == name)


def fill(fs) -> None:
    """Take every free byte of the file system ``fs`` with ``fallocate`` (one file, ``filler``)."""
    st = os.statvfs(fs)
    subprocess.run(["fallocate", "-l", str(st.f_bavail * st.f_frsize), str(fs / "filler")], check=True)


def test_a_full_disk_never_silences_the_box_and_a_request_is_never_replayed_twice(tiny_ckpt, tmp_path, small_fs):
    """The spool and WAV directories on a 1 MiB tmpfs that ``fallocate`` fills while a request
    plays: new requests are still accepted and played (``accepted.not_crash_safe`` says why),
    the playing one ends ``done``, and two clean restarts on the still-full disk replay nothing:
    its end was marked in place. Space again: journaled again, the condition clears."""
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "device", "wav_dir": str(small_fs / "wav")},
                         synthesis={"max_new_tokens": 150, "min_new_tokens": 150},
                         service={"spool_dir": str(small_fs / "spool"),
                                  "channels": [{"name": "main", "on_disconnect": "finish", "queue_len": 64}]})
    d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
    short = {"min_new_tokens": 5, "max_new_tokens": 5}
    try:
        c = d.connect()
        c.send({"type": "speak", "text": "磁盘满了，但我还在说话。", "seed": 1, "id": "keep-1"})
        assert c.events(("started", "error"))[-1]["type"] == "started"
        fill(small_fs)
        # the journal's last page may still take a record or two: short requests until one is not journaled
        unsafe = None
        for i in range(40):
            evs = d.request({"type": "speak", "text": "新的请求", "seed": 2, "id": f"full-{i}", "params": short})
            assert evs[-1]["type"] == "done" and evs[-1]["output"].startswith("device:"), evs
            if evs[0].get("not_crash_safe"):
                unsafe = evs[0]
                break
        assert unsafe is not None and "No space left on device" in unsafe["not_crash_safe"], unsafe
        assert "service.spool_dir" in unsafe["not_crash_safe"]
        (st,) = d.request({"type": "status"})                       # health names it (and the WAV fallback's disk)
        assert st["health"] == "degraded" and names(st) == {"storage_degraded", "wav_unwritable"}, st
        assert "No space left on device" in reason(st, "storage_degraded")
        done = c.events(("done", "error"))[-1]                      # the running one plays to its end
        assert done["type"] == "done" and done["id"] == "keep-1", done
        c.close()
    finally:
        assert d.stop() == 0, d.log()[-3000:]
    assert "marked ended in place" in d.log()
    for run in range(2):                                            # clean restarts, the disk still full
        d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
        try:
            back = d.request({"type": "speak", "text": "磁盘满了，但我还在说话。", "seed": 1, "id": "keep-1"})
            assert [e["type"] for e in back] == ["replayed", "done"], (run, back)     # remembered, not spoken again
        finally:
            assert d.stop() == 0, d.log()[-3000:]
        assert "replaying" not in d.log(), d.log()[-3000:]
    d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)                # full at start: degraded at the first write
    try:
        evs = d.request({"type": "speak", "text": "还是满的", "seed": 3, "id": "full-again", "params": short})
        assert evs[0].get("not_crash_safe") and evs[-1]["type"] == "done", evs
        assert names(d.request({"type": "status"})[0]) == {"storage_degraded", "wav_unwritable"}
        (small_fs / "filler").unlink()                              # space again: healthy with no request ...
        wait_for(lambda: d.request({"type": "status"})[0]["health"] == "healthy", 20, "healthy again",
                 show=lambda: d.request({"type": "status"})[0]["conditions"])
        evs = d.request({"type": "speak", "text": "又可以了", "seed": 3, "id": "ok-1", "params": short})   # ... journaled
        assert evs[-1]["type"] == "done" and not evs[0].get("not_crash_safe"), evs
        (st,) = d.request({"type": "status"})
        assert st["health"] == "healthy" and st["conditions"] == [], st
    finally:
        assert d.stop() == 0, d.log()[-3000:]


#: health check thresholds no loaded test machine misses: only the conditions under test show
LENIENT = {"at_start": False, "max_rtf": 100.0, "max_ttfb_ms": 60000.0, "max_memory_mib": 1e6}


def test_a_wav_request_on_a_full_disk_fails_with_no_space_and_leaves_no_file(tiny_ckpt, tmp_path, small_fs):
    """WAV output to a full tmpfs: health says ``wav_unwritable`` (unhealthy: WAV is the output)
    before any request fails; the request ends ``no_space`` naming audio.wav_dir (no traceback),
    no ``<id>.wav`` and no ``.part`` is left; space again: healthy at once, the next one is written."""
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "wav", "wav_dir": str(small_fs / "wav")},
                         synthesis={"max_new_tokens": 150, "min_new_tokens": 150}, health=LENIENT)
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        (small_fs / "wav").mkdir(exist_ok=True)
        assert d.request({"type": "status"})[0]["health"] == "healthy"
        fill(small_fs)
        (h,) = d.request({"type": "health"}, until=("health", "error"))
        assert h["verdict"] == "unhealthy" and names(h) == {"wav_unwritable"}, h
        assert "the disk is full" in reason(h, "wav_unwritable") and str(small_fs / "wav") in reason(h, "wav_unwritable")
        evs = d.request({"type": "speak", "text": "写不下了。", "seed": 1, "id": "nospace-1"})
        assert evs[-1]["type"] == "error" and evs[-1]["code"] == "no_space", evs
        assert "No space left on device" in evs[-1]["message"] and "audio.wav_dir" in evs[-1]["message"]
        assert sorted(p.name for p in (small_fs / "wav").iterdir()) == []
        (small_fs / "filler").unlink()
        (st,) = d.request({"type": "status"})                       # no request needed to see it
        assert st["health"] == "healthy" and st["conditions"] == [], st
        evs = d.request({"type": "speak", "text": "又可以了。", "seed": 2, "id": "space-1"})
        assert evs[-1]["type"] == "done" and evs[-1]["output"].endswith("space-1.wav"), evs
    finally:
        assert d.stop() == 0, d.log()[-3000:]
    assert "Traceback" not in d.log()


def test_a_stalled_synthesis_is_ended_and_the_worker_keeps_serving(tiny_config, tmp_path):
    from appliance.audio.output import AudioOutput
    from appliance.core import SynthParams
    from appliance.messages.protocol import Speak
    from appliance.service.request import Request as Item
    from appliance.service.worker import Worker
    from appliance.synth.pipeline import Pipeline

    cfg = dataclasses.replace(tiny_config, audio=dataclasses.replace(tiny_config.audio, output="wav",
                                                                     wav_dir=str(tmp_path / "wav")))
    p = Pipeline.from_config(cfg)
    hang, unstuck = threading.Event(), threading.Event()
    prefill = p.runner.prefill

    def stuck_prefill(slot, ids, spk_emb):       # the injected fault: one backend call hangs until released
        if hang.is_set():
            hang.clear()
            unstuck.wait(30)
        return prefill(slot, ids, spk_emb)
    p.runner.prefill = stuck_prefill
    audio = AudioOutput(cfg)
    audio.start()
    w = Worker(p, audio, queue_len={"main": 4}, stall_s=1.0)
    evs: dict[str, list] = {}
    lock = threading.Lock()

    def sink(ev):
        with lock:
            evs.setdefault(ev.id, []).append(ev)

    def submit(rid):
        sp = Speak(text="你好。", id=rid, seed=1, params=SynthParams(max_new_tokens=30))
        w.submit(Item(speak=sp, job=p.prepare(sp), channel="main", sink=sink))

    def ended(rid):
        with lock:
            return any(e.type in ("done", "error") for e in evs.get(rid, []))
    w.start()
    try:
        hang.set()
        t0 = time.monotonic()
        submit("stuck")
        submit("next")
        wait_for(lambda: ended("stuck"), 30, "the watchdog ending the stuck request", show=lambda: evs)
        unstuck.set()                            # the backend call returns (after the watchdog ended it)
        wait_for(lambda: ended("next"), 30, "the next request", show=lambda: evs)
        err = evs["stuck"][-1]
        assert err.type == "error" and err.code == "engine_error" and "no progress" in err.message, evs["stuck"]
        assert [e.type for e in evs["next"]] == ["accepted", "started", "done"], evs["next"]
        assert w.stall.ended == 1
        assert w.status()["main"]["active"] is None
        assert time.monotonic() - t0 < 20
    finally:
        w.stop(10)
        audio.close()
        p.close()


def test_a_read_only_wav_directory_degrades_the_device_fallback_and_clears_when_writable(tiny_ckpt, tmp_path, small_fs):
    """The sound device plays; its fallback's WAV directory is on a tmpfs remounted read-only
    while the daemon runs: health says ``wav_unwritable`` (degraded: requests still play), in
    ``status``, the ``health`` request and the ``health`` command; remounted read-write, it clears
    with no request in between."""
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "device", "on_device_error": "wav",
                                                     "wav_dir": str(small_fs / "wav")}, health=LENIENT)
    d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
    short = {"min_new_tokens": 5, "max_new_tokens": 5}
    try:
        assert d.request({"type": "status"})[0]["health"] == "healthy"
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
        (st,) = d.request({"type": "status"})
        assert st["health"] == "degraded" and names(st) == {"wav_unwritable"}, st
        assert "read-only file system" in reason(st, "wav_unwritable")
        assert "audio.on_device_error: wav" in reason(st, "wav_unwritable")
        evs = d.request({"type": "speak", "text": "还在说话", "seed": 2, "id": "ro-1", "params": short})
        assert evs[-1]["type"] == "done" and evs[-1]["output"].startswith("device:"), evs
        (h,) = d.request({"type": "health"}, until=("health", "error"))
        assert h["verdict"] == "degraded" and names(h) == {"wav_unwritable"}, h
        cli = subprocess.run([sys.executable, "-m", "appliance", "health", "--socket", str(d.socket)], cwd=str(ROOT),
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 1 and "wav_unwritable" in cli.stdout, cli.stdout
        wait_log(d.log, "health: wav_unwritable: ", 20)           # the verdict's watch (STATUS=, MQTT) saw it
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
        (st,) = d.request({"type": "status"})
        assert st["health"] == "healthy" and st["conditions"] == [], st
        wait_log(d.log, "health: wav_unwritable cleared", 20)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=False)
        assert d.stop() == 0, d.log()[-3000:]
