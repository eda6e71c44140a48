"""MQTT faults with a real mosquitto and the real daemon on the ALSA file device: commands sent
while the broker is down are spoken exactly once after it returns, and a request that came over
MQTT and was queued when the daemon was SIGKILLed is spoken once after the restart, announced
with ``replayed`` on the event topic (the broker's redelivery of it is not spoken twice)."""

from __future__ import annotations

import json
import signal
import time
import uuid

import numpy as np

from appliance.core import SynthesisRequest, SynthParams
from tests.fixtures_mqtt import Listener, mqtt_section
from tests.fixtures_service import (
    alsa_home,
    launch_daemon,
    resample_like_daemon,
    service_config,
)
from tests.test_faults_crash import occurrences, settled_size
from tests.waits import wait_for, wait_log

STEPS = 60


def _cfg(tiny_ckpt, tmp, broker):
    return service_config(tiny_ckpt, tmp, health={"at_start": False}, audio={"output": "device"},
                          synthesis={"max_new_tokens": STEPS, "min_new_tokens": STEPS, "voice": "seed:2"},
                          mqtt=mqtt_section(broker, max_payload_bytes=2048))


def _want(pipeline, text: str, seed: int) -> np.ndarray:
    job = pipeline.prepare(SynthesisRequest(text=text, id="w", seed=seed, params=SynthParams(max_new_tokens=STEPS)))
    pcm = resample_like_daemon(np.concatenate([c.samples for c in pipeline.run(job)]), 44100)
    return pcm[pcm != 0]


def _played(alsa, offset: int = 0) -> np.ndarray:
    p = alsa.read(offset)
    return p[p != 0]


def _online(lst, after=0.0, timeout_s=60.0):
    return lst.wait(lambda m: m.leaf == "availability" and m.payload == b"online" and m.at >= after,
                    timeout_s, "availability online")


def _pipeline(cfg: dict, tmp):
    from appliance.config import config_from_dict
    from appliance.synth.pipeline import Pipeline

    return Pipeline.from_config(config_from_dict(cfg, base_dir=str(tmp)))


def test_commands_sent_while_the_broker_is_down_are_spoken_exactly_once(tiny_ckpt, tmp_path, mqtt_broker_factory):
    broker = mqtt_broker_factory(persistence=True)
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    cfg = _cfg(tiny_ckpt, tmp_path, broker)
    base = f"{cfg['mqtt']['topic_prefix']}/{cfg['mqtt']['device_id']}"
    lst = Listener(broker, base, client_id=f"t-q1-{uuid.uuid4().hex[:6]}", clean_session=False)
    d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
    pipe = _pipeline(cfg, tmp_path)
    try:
        _online(lst)
        broker.stop()
        ids = [f"q{i}-{uuid.uuid4().hex[:4]}" for i in range(3)]
        for i, rid in enumerate(ids):                     # queued by the publisher's client (QoS 1)
            lst.c.publish(f"{base}/say", json.dumps({"text": f"断线时发送的第{i}句。", "id": rid, "seed": 40 + i},
                                                    ensure_ascii=False).encode(), qos=1)
        wait_log(d.log, "mqtt: lost the broker")          # the daemon saw the outage
        t_up = time.monotonic()
        broker.start()
        _online(lst, after=t_up, timeout_s=30)
        for rid in ids:
            assert lst.wait_event(rid, timeout_s=60)["type"] == "done"
        wants = [_want(pipe, f"断线时发送的第{i}句。", 40 + i) for i in range(len(ids))]
        wait_for(lambda: all(occurrences(_played(alsa), w) for w in wants), 30, "every command's audio in the file")
        played = _played(alsa)
        for rid, want in zip(ids, wants):
            assert len(occurrences(played, want)) == 1, rid
            terms = [e for e in lst.events(rid) if e["type"] in ("done", "error")]
            assert {e["type"] for e in terms} == {"done"}   # QoS 1 may repeat an event, never a second outcome
    finally:
        pipe.close()
        rc = d.stop()
        lst.close()
    assert rc == 0, d.log()[-3000:]


def test_mqtt_request_queued_at_a_crash_is_replayed_once(tiny_ckpt, tmp_path, mqtt_broker_factory):
    broker = mqtt_broker_factory(persistence=True)
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    cfg = _cfg(tiny_ckpt, tmp_path, broker)
    cfg["synthesis"].update(max_new_tokens=200)
    base = f"{cfg['mqtt']['topic_prefix']}/{cfg['mqtt']['device_id']}"
    lst = Listener(broker, base, client_id=f"t-r-{uuid.uuid4().hex[:6]}", clean_session=False)
    pipe = _pipeline(cfg, tmp_path)
    d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
    try:
        _online(lst)
        long_id, q_id = f"long-{uuid.uuid4().hex[:4]}", f"queued-{uuid.uuid4().hex[:4]}"
        lst.publish("say", {"text": "很长的一句话正在播放。", "id": long_id, "seed": 50,
                            "params": {"min_new_tokens": 200, "max_new_tokens": 200}})
        lst.wait_event(long_id, ("started",))
        lst.publish("say", {"text": "排队等候的一句。", "id": q_id, "seed": 51,
                            "params": {"min_new_tokens": STEPS, "max_new_tokens": STEPS}})
        lst.wait_event(q_id, ("accepted",))
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        off = settled_size(alsa)
        t_restart = time.monotonic()
        d = launch_daemon(tmp_path / "d", cfg, alsa=alsa)
        rep = lst.wait(lambda m: m.leaf == "event" and m.at >= t_restart and m.json().get("type") == "replayed"
                       and m.json().get("id") == q_id, 60, "replayed")
        assert rep.json()["state"] == "queued"
        done = lst.wait(lambda m: m.leaf == "event" and m.at >= t_restart and m.json().get("id") == q_id
                        and m.json().get("type") in ("done", "error"), 60, "done after the restart").json()
        assert done["type"] == "done", done
        lst.wait(lambda m: m.leaf == "event" and m.at >= t_restart and m.json().get("id") == long_id
                 and m.json().get("type") == "done", 60, "long done after the restart")
        want = _want(pipe, "排队等候的一句。", 51)
        wait_for(lambda: occurrences(_played(alsa, off), want), 30, "the replayed request's audio in the file")
        assert len(occurrences(_played(alsa, off), want)) == 1
    finally:
        pipe.close()
        rc = d.stop()
        lst.close()
    assert rc == 0, d.log()[-3000:]
