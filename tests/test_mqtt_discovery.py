"""Home Assistant MQTT discovery from the real daemon on a real mosquitto: the configs are
retained, valid JSON, one device, tied to the availability topic, and every key is one Home
Assistant's documented discovery schema allows (:data:`SCHEMA`); their templates render the
daemon's real status; the entities work (say, stop, voice); Home Assistant's ``online`` makes the
daemon publish them again."""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest

from appliance.audio.wav import read_wav
from appliance.config import config_from_dict
from appliance.transports.mqtt_discovery import Discovery
from appliance.transports.mqtt_payload import Topics
from tests.fixtures_mqtt import Listener, mqtt_section
from tests.fixtures_service import expected_pcm, launch_daemon, service_config

# ---------------------------------------------------------------- Home Assistant's schema
# From the "Configuration Variables" of https://www.home-assistant.io/integrations/<component>.mqtt/
# (text, notify, button, select, sensor, binary_sensor) and the schemas every MQTT entity shares
# (Home Assistant core, homeassistant/components/mqtt/schemas.py: MQTT_ENTITY_COMMON_SCHEMA with
# the availability keys, MQTT_ENTITY_DEVICE_INFO_SCHEMA, MQTT_ORIGIN_INFO_SCHEMA). "platform" is
# left out on purpose: it is allowed only in device-based discovery payloads, not in the
# per-entity config topics published here.

COMMON = {"availability", "availability_mode", "availability_template", "availability_topic",
          "payload_available", "payload_not_available", "device", "origin", "enabled_by_default",
          "encoding", "entity_category", "entity_picture", "icon", "json_attributes_template",
          "json_attributes_topic", "name", "object_id", "default_entity_id", "unique_id", "qos"}
SCHEMA = {  # component -> (required keys, allowed keys besides COMMON)
    "text": ({"command_topic"}, {"command_template", "max", "min", "mode", "pattern", "retain", "state_topic",
                                 "value_template"}),
    "notify": ({"command_topic"}, {"command_template", "retain"}),
    "button": (set(), {"command_topic", "command_template", "device_class", "payload_press", "retain"}),
    "select": ({"command_topic", "options"}, {"command_template", "optimistic", "retain", "state_topic",
                                              "value_template"}),
    "sensor": ({"state_topic"}, {"device_class", "expire_after", "force_update", "last_reset_value_template",
                                 "options", "state_class", "suggested_display_precision", "unit_of_measurement",
                                 "value_template"}),
    "binary_sensor": ({"state_topic"}, {"device_class", "expire_after", "force_update", "off_delay", "payload_off",
                                        "payload_on", "value_template"}),
}
DEVICE_KEYS = {"configuration_url", "connections", "hw_version", "identifiers", "manufacturer", "model", "model_id",
               "name", "serial_number", "suggested_area", "sw_version", "via_device"}
ORIGIN_REQUIRED, ORIGIN_KEYS = {"name"}, {"name", "sw_version", "support_url"}
ENTITY_CATEGORIES = {"config", "diagnostic"}            # ENTITY_CATEGORIES_SCHEMA
COMMANDS = {"text", "notify", "button", "select"}       # entities that publish to our command topics
DURATION_UNITS = {"d", "h", "min", "s", "ms", "µs"}


def check_ha_schema(component: str, c: dict) -> None:
    """Fail naming the key where ``c`` (one discovery config) breaks Home Assistant's schema."""
    required, extra = SCHEMA[component]
    assert required <= set(c), f"{component}: missing required {sorted(required - set(c))}"
    unknown = set(c) - COMMON - required - extra
    assert not unknown, f"{component}: keys Home Assistant does not know: {sorted(unknown)}"
    assert isinstance(c.get("unique_id"), str) and c["unique_id"], f"{component}: a device block needs unique_id"
    dev = c["device"]
    assert set(dev) <= DEVICE_KEYS, f"{component}: unknown device keys {sorted(set(dev) - DEVICE_KEYS)}"
    assert dev.get("identifiers") or dev.get("connections"), "device needs identifiers or connections"
    assert all(isinstance(i, str) for i in dev.get("identifiers", []))
    if "configuration_url" in dev:
        assert dev["configuration_url"].split("://")[0] in ("http", "https", "homeassistant")
    assert ORIGIN_REQUIRED <= set(c["origin"]) and set(c["origin"]) <= ORIGIN_KEYS, c["origin"]
    assert ("availability" in c) != ("availability_topic" in c), "availability and availability_topic are exclusive"
    assert c.get("qos", 0) in (0, 1, 2)
    if "entity_category" in c:
        assert c["entity_category"] in ENTITY_CATEGORIES
        assert not (component in ("sensor", "binary_sensor") and c["entity_category"] == "config"), \
            "Home Assistant refuses entity_category config for sensors"
    if component == "text":
        assert c.get("mode", "text") in ("text", "password") and 0 <= c.get("min", 0) <= c.get("max", 255) <= 255
    if component == "select":
        assert isinstance(c["options"], list) and all(isinstance(o, str) for o in c["options"])
    if component == "sensor" and c.get("device_class") == "enum":
        assert c.get("options") and "state_class" not in c and "unit_of_measurement" not in c
    if component == "sensor" and c.get("device_class") == "duration":
        assert c.get("unit_of_measurement") in DURATION_UNITS

CHANNELS = [{"name": "main"}, {"name": "cabin"}]
VOICES = [{"name": "default"}, {"name": "calm", "voice": "seed:11"}]
OBJECTS = {"text/say", "notify/speak", "select/voice", "sensor/last_rtf", "sensor/last_ttfb", "sensor/temperature",
           "sensor/throttle", "sensor/health", "button/stop_main", "button/stop_cabin", "sensor/queue_main", "sensor/queue_cabin",
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
    early = Listener(mqtt_broker, prefix)
    d = launch_daemon(tmp / "d", cfg)
    box.wait(lambda m: m.leaf == "availability" and m.payload == b"online", 60, "online")
    _configs(early)                   # published after 'online': a later subscriber gets retained copies
    early.close()
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


def test_payloads_follow_home_assistants_schema(tmp_path):
    """Without a broker: every config of a one-channel box against :data:`SCHEMA`; the device
    block gets suggested_area / configuration_url from config; the default device id is this
    box's own (two boxes no longer share ``appliance``)."""
    cfg = config_from_dict({"mqtt": {"suggested_area": "Kitchen", "configuration_url": "http://box.local:8080/"},
                            "voices": [{"name": "default"}, {"name": "calm", "voice": "seed:11"}]}, tmp_path)
    disc = Discovery(cfg, Topics.from_config(cfg), tmp_path)
    confs = disc.configs()
    assert len(confs) == 11
    for topic, c in confs:
        component = topic.split("/")[1]
        check_ha_schema(component, c)
        assert topic == f"homeassistant/{component}/{disc.node}/{c['unique_id'][len(disc.node) + 1:]}/config"
        assert c["device"]["suggested_area"] == "Kitchen"
        assert c["device"]["configuration_url"] == "http://box.local:8080/"
        assert c["availability_topic"] == f"chattts/{cfg.mqtt.box_id}/availability"
        assert (c.get("qos") == 1) == (component in COMMANDS), topic
    assert disc.node == "chattts_" + cfg.mqtt.box_id.replace(".", "_") and cfg.mqtt.box_id != "appliance"
    bare = Discovery(config_from_dict({}, tmp_path), Topics.from_config(config_from_dict({}, tmp_path)))
    assert all("suggested_area" not in c["device"] and "configuration_url" not in c["device"] for _, c in bare.configs())
    with pytest.raises(AssertionError, match="does not know"):          # the check itself bites
        check_ha_schema("sensor", {**confs[3][1], "command_topic": "x"})


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
    for key, (c, _) in confs.items():                                   # Home Assistant's schema
        check_ha_schema(key.split("/")[0], c)
        assert c["origin"]["name"] == "chattts-appliance"
        if key.split("/")[0] in COMMANDS:
            assert c["qos"] == 1, key                                   # our command topics are QoS 1
    assert {k for k, (c, _) in confs.items() if c.get("entity_category") == "diagnostic"} == \
        {"sensor/last_rtf", "sensor/last_ttfb", "sensor/temperature", "sensor/throttle", "sensor/health"}
    assert confs["select/voice"][0]["entity_category"] == "config"

    # the templates read the daemon's real status
    status = box.wait(lambda m: m.leaf == "status", 10, "status").json()
    assert _render(confs["sensor/queue_main"][0]["value_template"], status) == "0"
    assert _render(confs["binary_sensor/speaking_cabin"][0]["value_template"], status) == "OFF"
    assert _render(confs["sensor/throttle"][0]["value_template"], status) == status["throttle"]
    assert _render(confs["sensor/temperature"][0]["value_template"], status) == str(status["temperature_c"])
    health = confs["sensor/health"][0]
    assert _render(health["value_template"], status) == status["health"] and status["health"] in health["options"]
    sick = {**status, "health": "degraded", "conditions": [{"name": "throttled", "severity": "degraded", "for_s": 2.0,
                                                           "reason": "reduced_channels by memory: memory 1300.0MiB"}]}
    attrs = json.loads(_render(health["json_attributes_template"], sick))
    assert attrs == {"conditions": sick["conditions"], "reasons": ["reduced_channels by memory: memory 1300.0MiB"]}


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
