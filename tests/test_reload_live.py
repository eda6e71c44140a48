"""A reload that does what it says, on the real daemon (SIGHUP, a real ``NOTIFY_SOCKET``, the UNIX
socket, a real mosquitto, the real ``wyoming`` client, the ALSA file device): a burst of SIGHUPs
makes one reload; a voice added by a reload is spoken by name on the socket, MQTT and Wyoming (and
offered by ``describe`` and the MQTT voice select) without a restart; a volume change is heard in
the played PCM, exactly; a failed reload is named ``reload failed: <file>:<line>: <reason>`` by
``status`` and ``health`` until a good one."""

from __future__ import annotations

import asyncio
import signal

import numpy as np
import yaml
from wyoming.client import AsyncClient
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeVoice

from appliance.audio.volume import db_to_gain
from tests.fixtures_mqtt import Listener, mqtt_section
from tests.fixtures_service import (
    alsa_home,
    expected_pcm,
    launch_daemon,
    resample_like_daemon,
    service_config,
    wait_played,
)
from tests.test_wyoming_daemon import _wait_listening
from tests.waits import wait_for, wait_log

SHORT = {"max_new_tokens": 24, "min_new_tokens": 24}


def _edit(d, change) -> str:
    """Apply ``change(dict)`` to the daemon's config file; returns the new text."""
    data = yaml.safe_load(d.config_path.read_text())
    change(data)
    text = yaml.safe_dump(data)
    d.config_path.write_text(text)
    return text


def test_a_burst_of_sighups_makes_one_reload(tiny_ckpt, tmp_path, notify_socket):
    """The second and third SIGHUP arrive while the first one's reload is pending (after its
    RELOADING=1): one reload, one READY=1; a SIGHUP after it is a reload of its own."""
    d = launch_daemon(tmp_path / "d", service_config(tiny_ckpt, tmp_path))
    try:
        notify_socket.wait_for("READY", timeout=60)
        d.proc.send_signal(signal.SIGHUP)
        notify_socket.wait_for("RELOADING", timeout=10)    # handled: the next ones arrive apart from it
        d.proc.send_signal(signal.SIGHUP)
        d.proc.send_signal(signal.SIGHUP)
        notify_socket.wait_count("READY", 2, timeout=10)
        d.proc.send_signal(signal.SIGHUP)                    # later: its own reload
        notify_socket.wait_count("READY", 3, timeout=10)
        log = wait_log(d.log, "SIGHUP: reloaded", count=2)
        assert log.count("SIGHUP: reloaded") == 2 and len(notify_socket.with_key("RELOADING")) == 2, log[-2000:]
        assert "more within 0.5" in log, log[-2000:]
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_a_voice_added_by_reload_is_spoken_by_name_everywhere(tiny_ckpt, tmp_path, mqtt_broker):
    prefix = "ha-reload"
    cfg = service_config(tiny_ckpt, tmp_path, synthesis=SHORT,
                         wyoming={"enabled": True, "uris": [f"unix://{tmp_path}/run/wyoming.sock"]},
                         mqtt=mqtt_section(mqtt_broker, discovery_prefix=prefix, status_interval_s=1.0))
    cfg["voices"] = [{"name": "default", "voice": None, "description": ""}]
    d = launch_daemon(tmp_path / "d", cfg)
    box = Listener(mqtt_broker, f"{cfg['mqtt']['topic_prefix']}/{cfg['mqtt']['device_id']}")
    ha = Listener(mqtt_broker, prefix)
    try:
        _wait_listening(cfg["wyoming"]["uris"], d)
        before = d.request({"type": "speak", "text": "你好。", "voice": "bright", "id": "v0"})
        assert before[-1]["type"] == "error" and before[-1]["code"] == "bad_speaker", before

        _edit(d, lambda c: c["voices"].append({"name": "bright", "voice": "seed:7", "description": "a bright one"}))
        d.proc.send_signal(signal.SIGHUP)
        wait_log(d.log, "applied voices", alive=d.alive)

        done = d.request({"type": "speak", "text": "你好。", "voice": "bright", "id": "v1"})[-1]
        assert done["type"] == "done" and done["voice"] == "bright", done
        box.publish("say", {"text": "你好。", "voice": "bright", "id": "v2"})
        done = box.wait_event("v2")
        assert done["type"] == "done" and done["voice"] == "bright", done
        ha.wait(lambda m: m.leaf.startswith("select/") and "bright" in m.json().get("options", []), 20,
                "the voice select listing bright")

        async def wyoming() -> tuple:
            async with AsyncClient.from_uri(cfg["wyoming"]["uris"][0]) as c:
                await c.write_event(Describe().event())
                info = None
                while info is None:
                    ev = await asyncio.wait_for(c.read_event(), 60)
                    info = Info.from_event(ev) if ev.type == "info" else None
                await c.write_event(Synthesize(text="你好。", voice=SynthesizeVoice(name="bright")).event())
                got = []
                while not got or got[-1] not in ("audio-stop", "error"):
                    got.append((await asyncio.wait_for(c.read_event(), 60)).type)
                return [v.name for v in info.tts[0].voices], got

        names, got = asyncio.run(wyoming())
        assert names == ["default", "bright"], names                 # describe offers it ...
        assert got[0] == "audio-start" and "audio-chunk" in got and got[-1] == "audio-stop", got   # ... and speaks it
    finally:
        box.close()
        ha.close()
        assert d.stop() == 0, d.log()[-3000:]


def test_a_volume_change_is_heard_in_the_pcm(tiny_ckpt, tmp_path, service_pipeline):
    """The same request before and after a reload to audio.volume_db -14 and the channel's -6:
    the second is the first times 10^(-20/20) at the device, sample for sample."""
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    d = launch_daemon(tmp_path / "d", service_config(tiny_ckpt, tmp_path, audio={"output": "device"}), alsa=alsa)
    try:
        text, seed = "Turn the volume down.", 9
        (st,) = d.request({"type": "status"})
        main = st["channels"]["main"]
        assert main["output"] == "device" and main["volume_db"] == 0.0, main
        want = resample_like_daemon(expected_pcm(service_pipeline, text, seed), main["rate"])
        assert d.request({"type": "speak", "text": text, "seed": seed, "id": "loud"})[-1]["type"] == "done"
        played, loud = wait_played(alsa, want)
        assert np.abs(played - loud).max() <= 1e-6

        def quieter(c: dict) -> None:
            c["audio"]["volume_db"] = -14.0
            c["service"]["channels"] = [{"name": "main", "volume_db": -6.0}]

        _edit(d, quieter)
        d.proc.send_signal(signal.SIGHUP)
        wait_log(d.log, "applied volume", alive=d.alive)
        (st,) = d.request({"type": "status"})
        assert st["channels"]["main"]["volume_db"] == -20.0, st["channels"]["main"]
        assert d.request({"type": "speak", "text": text, "seed": seed, "id": "quiet"})[-1]["type"] == "done"
        quiet_want = (want * np.float32(db_to_gain(-20.0))).astype(np.float32)
        played, quiet = wait_played(alsa, quiet_want)
        assert np.abs(played - quiet).max() <= 1e-6
        assert 0.09 < np.sqrt(np.mean(quiet ** 2)) / np.sqrt(np.mean(loud ** 2)) < 0.11
        assert "restart needed" not in d.log()
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def _reload_reason(d) -> str:
    (st,) = d.request({"type": "status"})
    return next((c["reason"] for c in st.get("conditions", []) if c["name"] == "reload_failed"), "")


def test_a_failed_reload_is_named_with_file_and_line_until_a_good_one(tiny_ckpt, tmp_path):
    d = launch_daemon(tmp_path / "d", service_config(tiny_ckpt, tmp_path, synthesis=SHORT))
    path = str(d.config_path)
    try:
        good = d.config_path.read_text()
        bad = _edit(d, lambda c: c["synthesis"].update(top_p=7))
        line = next(i for i, s in enumerate(bad.splitlines(), 1) if s.strip().startswith("top_p:"))
        d.proc.send_signal(signal.SIGHUP)
        reason = wait_for(lambda: _reload_reason(d), 30, "status naming the failed reload")
        assert reason == f"reload failed: {path}:{line}: synthesis.top_p: expected a number between 0.0001 and 1, got 7.0", reason
        (h,) = d.request({"type": "health"}, timeout_s=300, until=("health", "error"))
        assert h["verdict"] == "degraded" and reason in h["reasons"], h
        (st,) = d.request({"type": "status"})
        assert st["health"] == "degraded", st

        d.config_path.write_text("synthesis:\n  seed: 3\n  top_p: [0.7,\n")       # not YAML: line 4
        d.proc.send_signal(signal.SIGHUP)
        reason = wait_for(lambda: "not valid YAML" in _reload_reason(d) and _reload_reason(d), 30, "the YAML error")
        assert reason.startswith(f"reload failed: {path}:4: not valid YAML: "), reason
        assert d.request({"type": "speak", "text": "你好。", "id": "kept"})[-1]["type"] == "done"   # still running

        d.config_path.write_text(good)
        blank = _edit(d, lambda c: c["synthesis"].update(voice=""))     # a UI that writes an empty field
        line = next(i for i, s in enumerate(blank.splitlines(), 1) if s.strip().startswith("voice:"))
        d.proc.send_signal(signal.SIGHUP)
        reason = wait_for(lambda: "synthesis.voice" in _reload_reason(d) and _reload_reason(d), 30, "the blank voice")
        assert reason.startswith(f"reload failed: {path}:{line}: synthesis.voice: '' is blank"), reason
        assert d.request({"type": "speak", "text": "你好。", "id": "voiced"})[-1]["type"] == "done"   # the old voice

        d.config_path.write_text(good)
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: not _reload_reason(d), 30, "the condition cleared by a good reload")
        (st,) = d.request({"type": "status"})
        assert st["health"] == "healthy" and st["conditions"] == [], st
    finally:
        assert d.stop() == 0, d.log()[-3000:]
