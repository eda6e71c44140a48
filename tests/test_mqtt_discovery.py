"""Home Assistant MQTT discovery from the real daemon on a real mosquitto: the configs are
retained, valid JSON, one device, tied to the availability topic; their templates render the
daemon's real status; the entities work (say, stop, voice); Home Assistant's ``online`` makes the
daemon publish them again."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest

from appliance.audio.wav import read_wav
from tests.fixtures_mqtt import Listener, mqtt_section
from tests.fixtures_service import expected_pcm, launch_daemon, service_config

CHANNELS = [{"name": "main"}, {"name": "cabin"}]
VOICES = [{"name": "default"}, {"name": "calm", "voice": "seed:11"}]
OBJECTS = {"text/say", "notify/speak", "select/voice", "sensor/last_rtf", "sensor/last_ttfb", "sensor/temperature",
           "sensor/throttle", "button/stop_main", "button/stop_cabin", "sensor/queue_main", "sensor/queue_cabin",
           "binary_sensor/speaking_main", "binary_sensor/speaking_cabin"}


@pytest.fixture(scope="module")
def ha(tiny_ckpt, tmp_path_factory, mqtt_broker):
    """(daemon with MQTT + discovery under a fresh prefix, Listener on the prefix, Listener on the box)."""
    tmp = tmp_path_factory.mktemp("mqtt_ha")
    prefix = f"ha-{uuid.uuid4().hex[:6]}"
    cfg = service_config(tiny_ckpt, tmp, health={"at_start": False},
                         service={"channels": CHANNELS}, wyoming={"voices": VOICES},
                         mqtt=mqtt_section(mqtt_broker, discovery_prefix=prefix, status_interval_s=1.0))
    base = f"{cfg['mqtt']['topic_prefix']}/{cfg['mqtt']['device_id']}"
    box = Listener(mqtt_broker, base)
    d = launch_daemon(tmp / "d", cfg)
    box.wait(lambda m: m.leaf == "availability" and m.payload == b"online", 60, "online")
    yield d, cfg, prefix, base, box
    assert d.stop() == 0, d.log()[-3000:]
    box.close()


def _configs(lst: Listener, after: float = 0.0, n: int = len(OBJECTS)) -> dict:
    """``{"<component>/<object>": (config dict, retained flag)}`` once ``n`` configs arrived after ``after``."""
    def got() -> dict:
        with lst.cv:
            return {"/".join(m.leaf.split("/")[0::2][:2]): (m.json(), m.retain) for m in lst.msgs
                    if m.leaf.endswith("/config") and m.at >= after}
    deadline = time.monotonic() + 30
    while len(got()) < n:
        assert time.monotonic() < deadline, sorted(got())
        time.sleep(0.1)
    return got()


def _render(template: str, status: dict) -> str:
    jinja2 = pytest.importorskip("jinja2")
    return jinja2.Environment().from_string(template).render(value_json=status).strip()


def test_discovery_configs_are_retained_valid_and_one_device(ha, mqtt_broker):
    d, cfg, prefix, base, box = ha
    late = Listener(mqtt_broker, prefix)              # subscribes after they were published: retained copies
    try:
        confs = _configs(late)
    finally:
        late.close()
    assert set(confs) == OBJECTS
    assert all(retained for _, retained in confs.values())
    node = f"chattts_{cfg['mqtt']['device_id']}"
    devices = {json.dumps(c["device"], sort_keys=True) for c, _ in confs.values()}
    assert len(devices) == 1 and json.loads(devices.pop())["identifiers"] == [node]
    assert len({c["unique_id"] for c, _ in confs.values()}) == len(OBJECTS)
    for c, _ in confs.values():
        assert c["availability_topic"] == f"{base}/availability" and c["payload_available"] == "online"
    assert confs["text/say"][0]["command_topic"] == f"{base}/say"
    assert confs["notify/speak"][0]["command_topic"] == f"{base}/say"
    assert confs["button/stop_cabin"][0]["command_topic"] == f"{base}/cancel"
    assert json.loads(confs["button/stop_cabin"][0]["payload_press"]) == {"channel": "cabin"}
    assert confs["select/voice"][0]["options"] == ["default", "calm"]
    assert confs["sensor/throttle"][0]["options"] == ["normal", "reduced_channels", "queue_low_priority", "alerts_only"]
    assert confs["sensor/last_ttfb"][0]["unit_of_measurement"] == "ms"
    assert confs["button/stop_main"][0]["name"] == "Stop main"          # two channels: names say which

    # the templates read the daemon's real status
    status = box.wait(lambda m: m.leaf == "status", 10, "status").json()
    assert _render(confs["sensor/queue_main"][0]["value_template"], status) == "0"
    assert _render(confs["binary_sensor/speaking_cabin"][0]["value_template"], status) == "OFF"
    assert _render(confs["sensor/throttle"][0]["value_template"], status) == status["throttle"]
    assert _render(confs["sensor/temperature"][0]["value_template"], status) == str(status["temperature_c"])


def test_entities_say_stop_and_voice(ha, mqtt_broker, service_pipeline):
    d, cfg, prefix, base, box = ha
    lst = Listener(mqtt_broker, prefix)
    try:
        confs = _configs(lst)
    finally:
        lst.close()

    # the voice select: state retained, and say messages without a voice use it
    assert box.wait(lambda m: m.leaf == "voice", 10, "voice state").payload == b"default"
    t0 = time.monotonic()
    box.publish("voice/set", "calm")
    assert box.wait(lambda m: m.leaf == "voice" and m.at >= t0, 10, "voice calm").payload == b"calm"
    rid = f"v-{uuid.uuid4().hex[:6]}"
    box.publish("say", {"text": "A calm voice.", "id": rid, "seed": 4})
    done = box.wait_event(rid)
    assert done["type"] == "done", done
    got, _ = read_wav(done["output"])
    want = expected_pcm(service_pipeline, "A calm voice.", 4, voice="seed:11")
    assert len(got) == len(want) and np.abs(got - np.clip(want, -1, 1)).max() <= 1 / 32767 + 1e-6
    t1 = time.monotonic()
    box.publish("voice/set", "nobody")                                # unknown: kept at calm
    box.publish("voice/set", "default")                               # handled after it, in order
    box.wait(lambda m: m.leaf == "voice" and m.at >= t1 and m.payload == b"default", 10, "voice default")
    states = [m.payload for m in box.msgs if m.leaf == "voice" and m.at >= t1]
    assert list(dict.fromkeys(states)) == [b"calm", b"default"], states      # 'nobody' left it at calm

    # the text entity publishes plain text on its command topic: it is spoken
    t0 = time.monotonic()
    box.publish(confs["text/say"][0]["command_topic"][len(base) + 1:], "Typed in Home Assistant.")
    ev = box.wait(lambda m: m.leaf == "event" and m.at >= t0 and m.json()["type"] == "done", 60, "done").json()
    assert ev["channel"] == "main"

    # the stop button cancels what runs on its channel
    rid = f"s-{uuid.uuid4().hex[:6]}"
    box.publish("say", {"text": "Stop me now. " * 12, "id": rid, "channel": "cabin", "seed": 1,   # 12 x 200 steps
                        "params": {"min_new_tokens": 200}})
    box.wait_event(rid, ("started",))
    press = confs["button/stop_cabin"][0]
    box.publish(press["command_topic"][len(base) + 1:], press["payload_press"])
    assert box.wait_event(rid)["code"] == "cancelled"


def test_republished_when_home_assistant_comes_online(ha, mqtt_broker):
    d, cfg, prefix, base, box = ha
    lst = Listener(mqtt_broker, prefix)
    try:
        _configs(lst)                                    # the retained copies
        t0 = time.monotonic()
        lst.publish("status", "online")                  # Home Assistant's birth message
        again = _configs(lst, after=t0)
        assert set(again) == OBJECTS
        assert "Home Assistant is online" in d.log()
        t1 = time.monotonic()
        lst.publish("status", "offline")                 # only 'online' triggers it
        box.publish("voice/set", "default")              # handled after it, in order: its state marks the end
        box.wait(lambda m: m.leaf == "voice" and m.at >= t1, 10, "voice state")
        with lst.cv:
            assert not [m for m in lst.msgs if m.leaf.endswith("/config") and m.at >= t1]
    finally:
        lst.close()
