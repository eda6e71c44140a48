"""MQTT command payloads -> requests or error events, the de-dup LRU, topics, TLS config errors
(no broker needed; the broker tests are in test_mqtt_daemon.py)."""

from __future__ import annotations

import re

import json

import pytest

from appliance.config import config_from_dict
from appliance.errors import ConfigError
from appliance.messages.protocol import Cancel, Done, HealthRequest, Speak
from appliance.transports.mqtt import MQTTBridge
from appliance.transports.mqtt_payload import (
    RecentIds,
    Topics,
    event_payload,
    parse_command,
)


def test_plain_text_is_spoken_on_the_default_channel():
    req, err = parse_command("say", "  Hello there [uv_break] again \n".encode(), 1024)
    assert err is None and isinstance(req, Speak)
    assert req.text == "Hello there [uv_break] again" and req.channel is None and len(req.id) == 12
    req, err = parse_command("say", "[laugh] 你好".encode(), 1024)   # '[' is text, not JSON
    assert err is None and req.text == "[laugh] 你好"


def test_json_say_carries_every_field():
    obj = {"text": "hi", "id": "r1", "channel": "cabin", "priority": "alert", "voice": "seed:3", "seed": 7,
           "params": {"temperature": 0.5, "max_new_tokens": 40}}
    req, err = parse_command("say", json.dumps(obj).encode(), 1024)
    assert err is None
    assert (req.id, req.channel, req.priority, req.voice, req.seed) == ("r1", "cabin", "alert", "seed:3", 7)
    assert req.params.temperature == 0.5 and req.params.max_new_tokens == 40
    req, err = parse_command("say", b'{"type": "speak", "text": "typed"}', 1024)
    assert err is None and req.text == "typed" and req.id


@pytest.mark.parametrize("payload, rid, needle", [
    (b"\xff\xfe not utf-8", None, "not valid UTF-8"),
    (b'{"text": "hi", "id": "x1"', None, "not valid JSON"),
    (b"x" * 65, None, "mqtt.max_payload_bytes"),
    (b'{"text": "hi", "id": "x2", "priority": "urgent"}', "x2", "priority"),
    (b'{"text": "hi", "id": "x3", "colour": "red"}', "x3", "colour"),
    (b'{"text": "hi", "id": "x4", "return_audio": true}', "x4", "return_audio"),
    (b'{"type": "cancel", "id": "x5"}', "x5", "say topic takes speak"),
    (b'{"id": "x6"}', "x6", "'text' is required"),
])
def test_bad_say_payloads_become_error_events_with_the_id_when_known(payload, rid, needle):
    req, err = parse_command("say", payload, 64)
    assert req is None
    assert err.type == "error" and err.code == "bad_request" and err.id == rid and needle in err.message, err


def test_cancel_and_health_payloads():
    assert parse_command("cancel", b" r7 ", 64) == (Cancel(id="r7"), None)
    assert parse_command("cancel", b'{"channel": "main"}', 64) == (Cancel(channel="main"), None)
    assert parse_command("cancel", b"", 64)[1].code == "bad_request"
    assert parse_command("cancel", b"{}", 64)[1].code == "bad_request"
    assert parse_command("health", b"", 64) == (HealthRequest(), None)
    assert parse_command("health", b"x" * 65, 64)[1].code == "bad_request"
    assert parse_command("shout", b"hi", 64)[1].code == "bad_request"


def test_event_payload_is_the_socket_json_without_newline():
    ev = Done(id="a", channel="main", ttfb_ms=1.0, rtf=0.5, audio_s=1.0, steps=47, steps_per_s=90.0)
    p = event_payload(ev)
    assert not p.endswith(b"\n") and json.loads(p)["type"] == "done" and json.loads(p)["id"] == "a"


def test_recent_ids_lru_and_refusal():
    r = RecentIds(16)
    assert r.add("a") and not r.add("a")          # second copy is a duplicate
    r.refused("a")                                 # refused before accept: forgotten, may retry
    assert "a" not in r and r.add("a")
    r.accepted("a")
    r.refused("a")                                 # an error after accept (cancel, failure) keeps it
    assert "a" in r and not r.add("a")
    for i in range(40):
        r.add(f"id{i}")
    assert len(r) == 16 and "a" not in r and "id39" in r and "id23" not in r


def test_topics_follow_prefix_and_device_id(tmp_path):
    cfg = config_from_dict({"mqtt": {"topic_prefix": "home/tts/", "device_id": "car1"}}, tmp_path)
    t = Topics.from_config(cfg)
    assert (t.of("say"), t.event, t.status, t.availability) == (
        "home/tts/car1/say", "home/tts/car1/event", "home/tts/car1/status", "home/tts/car1/availability")


def test_missing_ca_file_degrades_mqtt_naming_the_key(tmp_path):
    cfg = config_from_dict({"mqtt": {"enabled": True, "tls": True, "ca_file": "nope/ca.pem"}}, tmp_path)
    bridge = MQTTBridge(cfg, lambda req, sink: None, lambda: None)     # the box starts; MQTT waits for it
    (cond,) = bridge.link.flag()
    assert cond.name == "mqtt" and re.search(r"mqtt\.ca_file: .*nope/ca\.pem does not exist", cond.reason)
    assert not bridge.reload_tls()


def test_tls_failures_are_named_by_their_reason(tmp_path):
    import ssl

    from appliance.transports.mqtt_link import TlsFiles, tls_reason

    def verr(msg: str) -> ssl.SSLCertVerificationError:
        e = ssl.SSLCertVerificationError(1, f"[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: {msg}")
        e.verify_message = msg
        return e

    assert "has expired" in tls_reason(verr("certificate has expired"), "b")
    assert "CA this box does not trust" in tls_reason(verr("unable to get local issuer certificate"), "b")
    assert "not for host 'broker.lan'" in tls_reason(verr("Hostname mismatch, certificate is not valid for "
                                                          "'broker.lan'."), "broker.lan")
    assert tls_reason(ConnectionRefusedError(111, "Connection refused"), "b") is None
    # a CA bundle replaced on disk is what the next connection uses after load() (SIGHUP)
    from tests.fixtures_mqtt import make_tls_files
    a, b = make_tls_files(tmp_path / "a"), make_tls_files(tmp_path / "b")
    ca = tmp_path / "ca.pem"
    ca.write_bytes(a.ca.read_bytes())
    files = TlsFiles(config_from_dict({"mqtt": {"tls": True, "ca_file": str(ca)}}, tmp_path))
    files.load()
    before = files.ctx.get_ca_certs()
    ca.write_bytes(b.ca.read_bytes())
    files.load()
    assert files.ctx.get_ca_certs() != before and len(files.ctx.get_ca_certs()) == 1
