"""The real daemon (subprocess, tiny checkpoint) with MQTT on a real mosquitto: say over MQTT
plays on the ALSA file device, events / status / availability topics, de-dup, bad payloads,
cancel, health, retained commands, last will on SIGKILL, broker restart mid-session, broker down
at start, TLS + credentials."""

from __future__ import annotations

import shutil
import signal
import time
import uuid

import numpy as np
import pytest

from appliance.core import SynthesisRequest, SynthParams
from tests.fixtures_mqtt import Listener, free_port, make_tls_files, mqtt_section
from tests.fixtures_service import (
    alsa_home,
    launch_daemon,
    resample_like_daemon,
    service_config,
    wait_played,
)
from tests.waits import wait_log

STEPS = 60
"""synthesis.max_new_tokens of the test daemons (~1.3 s of audio at most)."""


def _config(tiny_ckpt, tmp, broker, mqtt: dict | None = None, **sections):
    return service_config(tiny_ckpt, tmp, health={"at_start": False},
                          synthesis={"max_new_tokens": STEPS, "voice": "seed:2"},
                          mqtt=mqtt_section(broker, max_payload_bytes=2048, **(mqtt or {})), **sections)


def _base(cfg: dict) -> str:
    return f"{cfg['mqtt']['topic_prefix']}/{cfg['mqtt']['device_id']}"


def _online(lst: Listener, after: float = 0.0, timeout_s: float = 60.0):
    return lst.wait(lambda m: m.leaf == "availability" and m.payload == b"online" and m.at >= after,
                    timeout_s, "availability online")


def _expected(pipeline, text: str, seed: int, steps: int = STEPS) -> np.ndarray:
    job = pipeline.prepare(SynthesisRequest(text=text, id="expected", seed=seed, params=SynthParams(max_new_tokens=steps)))
    return np.concatenate([c.samples for c in pipeline.run(job)])


def _assert_played(d, pipeline, text: str, seed: int, rate: int, steps: int = STEPS) -> None:
    played, want = wait_played(d.alsa, resample_like_daemon(_expected(pipeline, text, seed, steps), rate))
    assert np.abs(played - want).max() <= 1e-6, "played audio differs from the pipeline's output"


def _rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def mq(tiny_ckpt, tmp_path_factory, mqtt_broker):
    """(daemon on the ALSA file device with MQTT enabled, a Listener on its topics)."""
    tmp = tmp_path_factory.mktemp("mqtt_dev")
    alsa = alsa_home(tmp / "home", tmp / "played.raw")
    cfg = _config(tiny_ckpt, tmp, mqtt_broker, mqtt={"status_interval_s": 1.0}, audio={"output": "device"})
    lst = Listener(mqtt_broker, _base(cfg))
    d = launch_daemon(tmp / "d", cfg, alsa=alsa)
    _online(lst)
    yield d, lst
    rc = d.stop()
    assert rc == 0, d.log()[-4000:]
    # a clean stop says 'offline' itself (retained) after the last events
    lst.wait(lambda m: m.leaf == "availability" and m.payload == b"offline", 10, "availability offline")
    lst.close()


def _rate(lst: Listener) -> int:
    st = lst.wait(lambda m: m.leaf == "status" and m.json()["channels"]["main"].get("rate"), 10, "status").json()
    return st["channels"]["main"]["rate"]


def test_say_over_mqtt_plays_and_events_carry_the_id(mq, service_pipeline):
    d, lst = mq
    rid, text, seed = _rid("say"), "Hello over MQTT.", 21
    lst.publish("say", {"text": text, "id": rid, "seed": seed})
    done = lst.wait_event(rid)
    assert done["type"] == "done" and done["channel"] == "main" and done["seed"] == seed, done
    assert done["output"].startswith("device:") and done["steps"] > 0
    assert [e["type"] for e in lst.events(rid)] == ["accepted", "started", "done"]
    _assert_played(d, service_pipeline, text, seed, _rate(lst))


def test_plain_text_payload_is_spoken_on_the_default_channel(mq):
    d, lst = mq
    t0 = time.monotonic()
    lst.publish("say", "Plain text, no JSON.")
    acc = lst.wait(lambda m: m.leaf == "event" and m.at >= t0 and m.json()["type"] == "accepted", 30, "accepted").json()
    assert acc["channel"] == "main" and len(acc["id"]) == 12
    assert lst.wait_event(acc["id"])["type"] == "done"


def test_availability_and_status_are_retained(mq, mqtt_broker):
    d, lst = mq
    rid = _rid("st")
    lst.publish("say", {"text": "Status changes after this.", "id": rid, "seed": 3})
    lst.wait_event(rid)
    late = Listener(mqtt_broker, lst.base)     # a client that connects later gets the retained state
    try:
        av = late.wait(lambda m: m.leaf == "availability", 10, "retained availability")
        assert av.retain and av.payload == b"online"
        st = late.wait(lambda m: m.leaf == "status", 10, "retained status")
        assert st.retain
        s = st.json()
        assert s["type"] == "status" and s["state"] == "ready" and s["backend"]
        assert s["channels"]["main"]["queued"] == 0 and s["channels"]["main"]["output"] == "device"
        assert s["last_rtf"] > 0 and s["last_ttfb_ms"] > 0 and s["throttle"]
    finally:
        late.close()


def test_status_is_republished_periodically_when_idle(mq):
    d, lst = mq
    t0 = time.monotonic()
    first = lst.wait(lambda m: m.leaf == "status" and m.at >= t0, 5, "a status")
    second = lst.wait(lambda m: m.leaf == "status" and m.at >= first.at + 0.5, 5, "the next status")
    assert 0.5 <= second.at - first.at <= 4.0          # mqtt.status_interval_s = 1 s (slack for load)
    assert second.json()["state"] == "ready"


def test_same_id_twice_speaks_once(mq):
    d, lst = mq
    rid = _rid("dup")
    req = {"text": "Only once, please.", "id": rid, "seed": 5}
    lst.publish("say", req)
    lst.publish("say", req)                    # a redelivery: dropped while the first runs
    assert lst.wait_event(rid)["type"] == "done"
    lst.publish("say", req)                    # and after it finished
    marker = _rid("marker")                    # commands are handled in order: once the marker
    lst.publish("say", {"text": "Marker.", "id": marker, "seed": 6})   # is accepted, the copies are done with
    lst.wait_event(marker, ("accepted",))
    assert [e["type"] for e in lst.events(rid)] == ["accepted", "started", "done"]
    assert d.log().count(f"accepted {rid} ") == 1
    assert d.log().count(f"say {rid} is a duplicate") == 2
    lst.wait_event(marker)


def test_bad_payloads_each_get_an_error_event_and_a_valid_one_still_plays(mq, service_pipeline):
    d, lst = mq
    bad = [
        (b"\xff\xfe\x00 not UTF-8", None, "bad_request"),
        (b'{"text": "unterminated", "id": "bj"', None, "bad_request"),
        ({"text": "Nobody listens there.", "id": _rid("ch"), "channel": "kitchen"}, "id", "unknown_channel"),
        ("x" * 3000, None, "bad_request"),                      # > mqtt.max_payload_bytes (2048)
        ({"text": "hi", "id": _rid("pr"), "priority": "urgent"}, "id", "bad_request"),
        ({"text": "   ", "id": _rid("empty")}, "id", "bad_text"),
    ]
    for payload, rid_key, code in bad:
        rid = payload[rid_key] if rid_key else None
        t0 = time.monotonic()
        lst.publish("say", payload)
        ev = lst.wait(lambda m: m.leaf == "event" and m.at >= t0, 30, f"error for {payload!r:.40}").json()
        assert ev["type"] == "error" and ev["code"] == code and ev["id"] == rid and ev["message"], (payload, ev)
    # a refused id is forgotten: the same id, fixed, is accepted
    fixed = bad[2][0] | {"channel": "main", "seed": 8}
    t0 = time.monotonic()
    lst.publish("say", fixed)
    assert lst.wait_event(fixed["id"], after=t0)["type"] == "done"
    rid, text, seed = _rid("ok"), "Still speaking after bad payloads.", 9
    lst.publish("say", {"text": text, "id": rid, "seed": seed})
    assert lst.wait_event(rid)["type"] == "done"
    _assert_played(d, service_pipeline, text, seed, _rate(lst))
    assert d.proc.poll() is None


def test_cancel_over_mqtt_gives_one_cancelled_event(mq):
    d, lst = mq
    rid = _rid("cx")
    lst.publish("say", {"text": "This one is cancelled while it plays.", "id": rid, "seed": 1,
                        "params": {"max_new_tokens": STEPS}})
    lst.wait_event(rid, ("started",))
    lst.publish("cancel", rid)
    ev = lst.wait_event(rid)
    assert ev["type"] == "error" and ev["code"] == "cancelled", ev
    marker = _rid("marker")
    lst.publish("say", {"text": "After the cancel.", "id": marker, "seed": 2})
    lst.wait_event(marker)
    assert [e["type"] for e in lst.events(rid) if e["type"] in ("done", "error")] == ["error"]
    t0 = time.monotonic()
    lst.publish("cancel", {"id": "no-such-request"})
    ev = lst.wait(lambda m: m.leaf == "event" and m.at >= t0, 10, "cancel refusal").json()
    assert ev["code"] == "bad_request" and ev["id"] == "no-such-request" and "nothing to cancel" in ev["message"]


def test_health_over_mqtt(mq):
    d, lst = mq
    t0 = time.monotonic()
    lst.publish("health", b"")
    ev = lst.wait(lambda m: m.leaf == "event" and m.at >= t0 and m.json()["type"] == "health", 120, "health").json()
    assert isinstance(ev["healthy"], bool) and ev["rtf"] > 0 and ev["steps_per_s"] > 0


def test_normalize_over_mqtt_is_a_dry_run(mq):
    d, lst = mq
    rid = _rid("norm")
    lst.publish("normalize", {"text": "你好😀，A12B34", "id": rid})
    ev = lst.wait_event(rid, types=("normalized", "error"))
    assert ev["type"] == "normalized" and ev["spoken"] == ["你好，A一二B三四"], ev
    assert ev["unspeakable_names"] == ["😀 (U+1F600 GRINNING FACE)"]
    assert [e["type"] for e in lst.events(rid)] == ["normalized"]   # nothing queued or spoken


def test_last_will_offline_when_the_daemon_is_killed(tiny_ckpt, tmp_path, mqtt_broker):
    """SIGKILL -> the broker publishes the last will ``offline`` (retained); a say sent while the
    daemon is dead waits in its persistent session and is spoken when it is back (same client
    id); a retained say found at connect is refused, not spoken."""
    cfg = _config(tiny_ckpt, tmp_path, mqtt_broker, mqtt={"keepalive_s": 5})
    lst = Listener(mqtt_broker, _base(cfg))
    stale = _rid("retained")
    lst.c.publish(f"{_base(cfg)}/say", f'{{"text": "Stale.", "id": "{stale}"}}', qos=1, retain=True).wait_for_publish(10)
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        _online(lst)
        ev = lst.wait_event(stale, timeout_s=10)
        assert ev["type"] == "error" and ev["code"] == "bad_request" and "retained" in ev["message"], ev
        assert [e["type"] for e in lst.events(stale)] == ["error"]
        lst.c.publish(f"{_base(cfg)}/say", b"", qos=1, retain=True).wait_for_publish(10)    # clear it
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        off = lst.wait(lambda m: m.leaf == "availability" and m.at >= t0, 15, "last will")
        assert off.payload == b"offline"
        late = Listener(mqtt_broker, _base(cfg))
        try:
            av = late.wait(lambda m: m.leaf == "availability", 10, "retained availability")
            assert av.retain and av.payload == b"offline"
        finally:
            late.close()
        queued = _rid("while-dead")
        lst.publish("say", {"text": "Sent while the daemon was down.", "id": queued, "seed": 3})
        t1 = time.monotonic()
        d = launch_daemon(tmp_path / "d2", cfg)         # systemd's restart: same config, same client id
        _online(lst, after=t1)
        done = lst.wait_event(queued, timeout_s=30)
        assert done["type"] == "done", done
        assert "session present: True" in d.log()
    finally:
        if d.proc.poll() is None:
            assert d.stop() == 0, d.log()[-3000:]
        lst.close()


def test_broker_restart_mid_session(tiny_ckpt, tmp_path, mqtt_broker_factory, service_pipeline):
    """A request accepted before the outage is still spoken and its events arrive after the
    reconnect; a request sent after the reconnect plays too."""
    broker = mqtt_broker_factory(persistence=True)     # keeps the listener's session over the restart
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    cfg = _config(tiny_ckpt, tmp_path, broker, audio={"output": "device"})
    lst = Listener(broker, _base(cfg), client_id=f"t-persist-{uuid.uuid4().hex[:6]}", clean_session=False)
    d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
    try:
        _online(lst)
        rate = _rate(lst)
        a, text_a = _rid("before"), "Accepted before the broker went away."
        lst.publish("say", {"text": text_a, "id": a, "seed": 31})
        lst.wait_event(a, ("accepted",))
        broker.stop()
        wait_log(d.log, "mqtt: lost the broker")
        wait_log(d.log, f"done {a} -> device:")        # A synthesized and played meanwhile
        broker.start()
        t_up = time.monotonic()
        _online(lst, after=t_up, timeout_s=30)         # the daemon reconnected and said so
        done_a = lst.wait_event(a, timeout_s=30)
        assert done_a["type"] == "done", done_a
        # QoS 1 is at-least-once: across the outage an event may arrive twice, never out of order
        assert list(dict.fromkeys(e["type"] for e in lst.events(a))) == ["accepted", "started", "done"]
        assert "lost the broker" in d.log()
        _assert_played(d, service_pipeline, text_a, 31, rate)
        b, text_b = _rid("after"), "Sent after the reconnect."
        lst.publish("say", {"text": text_b, "id": b, "seed": 32})
        assert lst.wait_event(b, timeout_s=30)["type"] == "done"
        _assert_played(d, service_pipeline, text_b, 32, rate)
    finally:
        rc = d.stop()
        lst.close()
    assert rc == 0, d.log()[-4000:]


def test_tls_and_credentials(tiny_ckpt, tmp_path, mqtt_broker_factory):
    """A TLS-only broker that refuses anonymous clients: the daemon connects with mqtt.tls,
    mqtt.ca_file and a user/password and serves a say; a wrong password is logged, not fatal."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test CA (apt-get install openssl)")
    tls = make_tls_files(tmp_path / "tls")
    broker = mqtt_broker_factory(tls=tls, users={"box": "s3cret"})
    good = {"tls": True, "ca_file": str(tls.ca), "username": "box", "password": "s3cret"}
    cfg = _config(tiny_ckpt, tmp_path / "good", broker, mqtt=good)
    lst = Listener(broker, _base(cfg), ca=tls.ca, username="box", password="s3cret")
    d = launch_daemon(tmp_path / "good" / "d", cfg)
    bad_cfg = _config(tiny_ckpt, tmp_path / "bad", broker, mqtt=good | {"password": "wrong"})
    bad = launch_daemon(tmp_path / "bad" / "d", bad_cfg)
    try:
        _online(lst)
        rid = _rid("tls")
        lst.publish("say", {"text": "Over TLS.", "id": rid, "seed": 4})
        done = lst.wait_event(rid)
        assert done["type"] == "done" and done["output"].endswith(".wav"), done
        wait_log(bad.log, "refused the connection", 20)
        assert "mqtt.username/password" in bad.log()
        conds = {c["name"]: c["reason"] for c in bad.request({"type": "status"})[0]["conditions"]}
        assert "refused the connection" in conds.get("mqtt", ""), conds           # the broker's reason, in health
        assert bad.request({"type": "status"})[0]["state"] == "ready"     # the socket still serves
    finally:
        rcs = (d.stop(), bad.stop())
        lst.close()
    assert rcs == (0, 0), d.log()[-3000:] + bad.log()[-3000:]


def test_broker_down_at_start_then_up(tiny_ckpt, tmp_path, mqtt_broker_factory):
    """The daemon starts without a broker (the socket serves), connects once one appears, and a
    say sent then plays; it stops promptly either way."""
    port = free_port()
    cfg = service_config(tiny_ckpt, tmp_path, health={"at_start": False}, synthesis={"max_new_tokens": STEPS},
                         mqtt={"enabled": True, "host": "127.0.0.1", "port": port, "topic_prefix": "test",
                               "device_id": _rid("late"), "reconnect_min_s": 1, "reconnect_max_s": 1})
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        assert d.request({"type": "status"})[0]["state"] == "ready"
        wait_log(d.log, "cannot reach the broker", 20)
        broker = mqtt_broker_factory(port=port)
        lst = Listener(broker, _base(cfg))
        try:
            _online(lst, timeout_s=20)
            rid = _rid("late")
            lst.publish("say", {"text": "The broker came late.", "id": rid, "seed": 2})
            assert lst.wait_event(rid)["type"] == "done"
        finally:
            lst.close()
    finally:
        t0 = time.monotonic()
        rc = d.stop()
    assert rc == 0 and time.monotonic() - t0 < 15, d.log()[-3000:]
