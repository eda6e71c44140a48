"""The one health verdict (appliance.ops.verdict): each condition is named with its reason and
clears when its cause clears, the same in the ``health`` and ``status`` replies, sd_notify
``STATUS=`` (a real NOTIFY_SOCKET) and the MQTT health sensor (a real mosquitto); the throttle
is driven through the telemetry's sysfs source over a fixture tree (``telemetry.root``)."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.config import config_from_dict
from appliance.core import DEGRADED, UNHEALTHY, Condition, ConditionFlag
from appliance.messages.protocol import HealthReply
from appliance.ops.monitor import Monitor
from appliance.ops.telemetry import open_telemetry
from appliance.ops.verdict import CheckRecord, Health
from tests.fixtures_mqtt import Listener, mqtt_section
from tests.fixtures_service import ROOT, alsa_home, launch_daemon, service_config
from tests.waits import wait_for


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def board(root: Path, temp_c: float = 50.0, avail_kb: int = 6_000_000) -> Path:
    """A fixture /sys + /proc tree: one tj zone with a passive trip at 90 C, and a meminfo."""
    z = root / "sys/class/thermal/thermal_zone0"
    z.mkdir(parents=True, exist_ok=True)
    (z / "type").write_text("tj-thermal\n")
    (z / "trip_point_0_type").write_text("passive\n")
    (z / "trip_point_0_temp").write_text("90000\n")
    set_board(root, temp_c, avail_kb)
    return root


def set_board(root: Path, temp_c: float, avail_kb: int = 6_000_000) -> None:
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc/meminfo").write_text(f"MemTotal: 8000000 kB\nMemAvailable: {avail_kb} kB\n")
    (root / "sys/class/thermal/thermal_zone0/temp").write_text(f"{int(temp_c * 1000)}\n")


def test_the_verdict_assembles_every_source_and_returns_to_healthy():
    clock = Clock()
    reload = ConditionFlag("reload_failed", clock=clock)
    devices = ConditionFlag("device_missing", UNHEALTHY, clock=clock)
    h = Health([reload, devices], clock=clock)
    assert h.verdict().word == "healthy" and h.verdict().healthy and h.fields() == {"health": "healthy", "conditions": []}

    reload.set("reload failed: config.yaml:3: service.max_text_chars: -1 is below 1")
    clock.t += 1
    v = h.verdict()
    assert v.word == DEGRADED and [c.name for c in v.conditions] == ["reload_failed"]
    assert v.reasons == ["reload failed: config.yaml:3: service.max_text_chars: -1 is below 1"]

    clock.t += 2
    devices.set("channel main: sound device missing: looked for 'usb'")
    v = h.verdict()
    assert v.word == UNHEALTHY
    assert [c.name for c in v.conditions] == ["device_missing", "reload_failed"]      # the unhealthy first
    assert v.wire()[1] == {"name": "reload_failed", "severity": DEGRADED, "for_s": 3.0,
                           "reason": "reload failed: config.yaml:3: service.max_text_chars: -1 is below 1"}
    assert "channel main: sound device missing: looked for 'usb'" in v.conditions[0].reason
    assert v.summary().startswith("unhealthy: device_missing (channel main")
    clock.t += 5
    assert h.verdict().wire()[0]["for_s"] == 5.0                                     # since it was raised

    devices.clear()
    reload.update(None)
    assert h.verdict().healthy and h.reply().verdict == "healthy"


def test_a_source_that_fails_is_a_condition_not_a_silent_healthy(caplog):
    def broken():
        raise OSError("sensor gone")

    h = Health([broken])
    with caplog.at_level(logging.ERROR, logger="appliance.ops.verdict"):
        v = h.verdict()
        h.verdict()
    assert v.word == DEGRADED and v.conditions[0].name == "health_source" and "sensor gone" in v.reasons[0]
    assert sum("health source" in r.message for r in caplog.records) == 1             # logged once


def test_a_condition_checks_its_severity():
    with pytest.raises(ValueError, match="severity"):
        Condition("x", "y", 0.0, "bad")


def test_the_field_checks_findings_hold_until_a_check_passes():
    clock = Clock()
    rec = CheckRecord(clock=clock)
    h = Health([rec], clock=clock)
    slow = HealthReply(healthy=False, conditions=[{"name": "rtf", "severity": DEGRADED, "reason": "rtf 1.32 > max 1.00"}])
    rec.record(slow)
    clock.t += 10
    rec.record(slow)                                   # found again: since kept
    r = h.reply(slow)
    assert not r.healthy and r.verdict == DEGRADED and r.reasons == ["rtf 1.32 > max 1.00"]
    assert r.conditions[0]["for_s"] == 10.0
    rec.record(HealthReply(healthy=True))
    assert h.reply(HealthReply(healthy=True, rtf=0.3)).healthy


def test_the_throttle_names_its_resource_and_clears(tmp_path):
    """Through the real sysfs source over a fixture tree: heat names ``thermal``, low MemAvailable
    names ``memory``; each clears when its reading does."""
    root = board(tmp_path)
    cfg = config_from_dict({"throttle": {"min_dwell_s": 0}})
    mon = Monitor(cfg, telemetry=open_telemetry("sysfs", 60.0, root=str(root)))
    try:
        h = Health([mon.conditions])
        mon._on_reading(mon.telemetry.read())
        assert h.verdict().healthy
        set_board(root, 86.0)                                                      # >= 90 - 8
        mon._on_reading(mon.telemetry.read())
        (c,) = h.verdict().conditions
        assert c.name == "throttled" and c.reason.startswith("queue_low_priority by thermal: temperature 86.0C")
        set_board(root, 50.0, avail_kb=100 * 1024)                                 # cool, but 100 MiB left
        mon._on_reading(mon.telemetry.read())
        (c,) = h.verdict().conditions
        assert c.reason.startswith("alerts_only by memory: available memory 100.0MiB"), c.reason
        set_board(root, 50.0)
        for _ in range(3):                                                         # one level per reading
            mon._on_reading(mon.telemetry.read())
        assert h.verdict().healthy, h.verdict().reasons
    finally:
        mon.close()


# ------------------------------------------------------------------------------- the daemon


def _status_line(notify_socket) -> str:
    msgs = notify_socket.with_key("STATUS")
    return msgs[-1].fields["STATUS"] if msgs else ""


def test_daemon_names_each_condition_everywhere_and_clears(tiny_ckpt, tmp_path, notify_socket, mqtt_broker):
    root = board(tmp_path / "board")
    cfg = service_config(tiny_ckpt, tmp_path, telemetry={"source": "sysfs", "interval_s": 0.2, "root": str(root)},
                         throttle={"min_dwell_s": 0.0},
                         health={"at_start": False, "max_rtf": 100.0, "max_ttfb_ms": 60000.0, "max_memory_mib": 1e6},
                         mqtt=mqtt_section(mqtt_broker))
    base = f"{cfg['mqtt']['topic_prefix']}/{cfg['mqtt']['device_id']}"
    box = Listener(mqtt_broker, base)
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        notify_socket.wait_for("READY", timeout=60)
        (st,) = d.request({"type": "status"})
        assert st["health"] == "healthy" and st["conditions"] == [], st

        set_board(root, 86.0)                                    # hot: the throttle, named by the watch
        line = wait_for(lambda: "degraded: throttled (queue_low_priority by thermal" in _status_line(notify_socket)
                        and _status_line(notify_socket), 20, "STATUS names the thermal throttle",
                        show=lambda: _status_line(notify_socket))
        assert "temperature 86.0C" in line
        (st,) = d.request({"type": "status"})
        assert st["health"] == "degraded" and [c["name"] for c in st["conditions"]] == ["throttled"]
        m = box.wait(lambda m: m.leaf == "status" and m.json().get("health") == "degraded", 20, "MQTT status degraded")
        assert "thermal" in m.json()["conditions"][0]["reason"]

        good = d.config_path.read_text()
        d.config_path.write_text(good.replace("max_text_chars: 300", "max_text_chars: -1"))
        d.proc.send_signal(signal.SIGHUP)                        # a reload that fails
        wait_for(lambda: "reload_failed (reload failed: " in _status_line(notify_socket), 20,
                 "STATUS names the failed reload", show=lambda: _status_line(notify_socket))
        (h,) = d.request({"type": "health"}, until=("health", "error"))
        assert h["type"] == "health" and not h["healthy"] and h["verdict"] == "degraded", h
        assert [c["name"] for c in h["conditions"]] == ["throttled", "reload_failed"], h
        assert h["rtf"] > 0 and any("max_text_chars" in r for r in h["reasons"]), h
        cli = subprocess.run([sys.executable, "-m", "appliance", "health", "--socket", str(d.socket)], cwd=str(ROOT),
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 1 and "DEGRADED" in cli.stdout and "reload_failed" in cli.stdout, cli.stdout

        cleared = time.monotonic()
        set_board(root, 50.0)                                    # the causes clear ...
        d.config_path.write_text(good)
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: _status_line(notify_socket).endswith("; healthy"), 20, "STATUS back to healthy",
                 show=lambda: _status_line(notify_socket))
        (st,) = d.request({"type": "status"})
        assert st["health"] == "healthy" and st["conditions"] == [], st
        box.wait(lambda m: m.leaf == "status" and m.at >= cleared and m.json().get("health") == "healthy",
                 20, "MQTT status healthy again")
        cli = subprocess.run([sys.executable, "-m", "appliance", "health", "--socket", str(d.socket), "--json"],
                             cwd=str(ROOT), capture_output=True, text=True, timeout=120)
        assert cli.returncode == 0 and json.loads(cli.stdout)["verdict"] == "healthy", cli.stdout
    finally:
        assert d.stop() == 0, d.log()[-3000:]
        box.close()



def test_daemon_names_a_lost_sound_device_and_clears_when_it_is_back(tiny_ckpt, tmp_path):
    """The ALSA file device's pacer killed while a request plays: the device fails (the request
    completes to WAV) and health says ``device_missing`` naming the channel; the reopen brings
    the device back (a fresh pacer) and the verdict is healthy again."""
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    d = launch_daemon(tmp_path / "d", service_config(tiny_ckpt, tmp_path, audio={"output": "device"}), alsa=alsa)
    try:
        c = d.connect()
        c.send({"type": "speak", "text": "The speaker is unplugged while I talk.", "seed": 31, "id": "cut"})
        c.events(("started",))
        wait_for(lambda: alsa.size() > 0, 30, "the request is being heard")
        alsa.unplug()
        c.events(("done", "error"))
        c.close()

        def health() -> dict:
            return d.request({"type": "status"})[0]

        st = wait_for(lambda: (s := health())["health"] == "unhealthy" and s, 20, "device_missing", show=health)
        (cond,) = st["conditions"]
        assert cond["name"] == "device_missing" and cond["reason"].startswith("channel main: sound device"), cond
        alsa.replug()
        wait_for(lambda: health()["health"] == "healthy", 30, "the device back, healthy again", show=health)
    finally:
        assert d.stop() == 0, d.log()[-3000:]
