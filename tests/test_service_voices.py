"""The real daemon with named voices, on a real socket and a real mosquitto: ``"voice": "calm"``
works on the socket, over MQTT and with ``say --voice calm``; an unknown name is refused naming
what the box offers; ``done`` reports the voice used and the sentences that produced no audio;
the MQTT voice select's choice survives a restart; clearing a retained ``say`` (an empty
retained message, as the daemon's own error advises) produces no event; empty text gets one
wording wherever it is caught."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from appliance.audio.wav import read_wav
from appliance.core import SynthesisRequest, SynthParams
from appliance.errors import EmptyResultError
from tests.fixtures_mqtt import Listener, mqtt_section
from tests.fixtures_service import ROOT, expected_pcm, launch_daemon, service_config

VOICES = [{"name": "default"}, {"name": "calm", "voice": "seed:11", "description": "a calm voice"}]


def _rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def box(tiny_ckpt, tmp_path_factory, mqtt_broker):
    """(daemon with voices and MQTT, its config, a Listener on its topics)."""
    tmp = tmp_path_factory.mktemp("voices_daemon")
    cfg = service_config(tiny_ckpt, tmp, health={"at_start": False}, mqtt=mqtt_section(mqtt_broker))
    cfg["voices"] = VOICES
    lst = Listener(mqtt_broker, f"{cfg['mqtt']['topic_prefix']}/{cfg['mqtt']['device_id']}")
    d = launch_daemon(tmp / "d", cfg)
    lst.wait(lambda m: m.leaf == "availability" and m.payload == b"online", 60, "online")
    yield d, cfg, lst
    assert d.stop() == 0, d.log()[-3000:]
    lst.close()


def _played(done: dict) -> np.ndarray:
    return read_wav(done["output"])[0]


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    return len(got) == len(want) and float(np.abs(got - np.clip(want, -1, 1)).max()) <= 1 / 32767 + 1e-6


def test_voice_names_on_the_socket(box, service_pipeline):
    d, cfg, _ = box
    evs = d.request({"text": "A calm voice.", "voice": "calm", "seed": 4, "id": _rid("calm")})
    done = evs[-1]
    assert done["type"] == "done", evs
    assert done["voice"] == "calm"
    assert _same(_played(done), expected_pcm(service_pipeline, "A calm voice.", 4, voice="seed:11"))
    plain = d.request({"text": "No voice named.", "seed": 4, "id": _rid("plain")})[-1]
    assert plain["type"] == "done" and plain["voice"] == "default"           # synthesis.voice, by its name
    raw = d.request({"text": "A seed voice.", "voice": "seed:11", "seed": 4, "id": _rid("seed")})[-1]
    assert raw["type"] == "done" and raw["voice"] == "seed:11"
    err = d.request({"text": "Hello.", "voice": "clam", "id": _rid("clam")})[-1]
    assert err["type"] == "error" and err["code"] == "bad_speaker", err
    assert err["message"].startswith("unknown voice 'clam'; this box offers: default, calm")


def test_say_voice_on_the_command_line(box):
    d, cfg, _ = box
    r = subprocess.run([sys.executable, "-m", "appliance", "say", "--socket", str(d.socket), "--voice", "calm",
                        "--seed", "3", "--max-new-tokens", "30", "Hello there."],
                       cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "voice calm, seed 3" in r.stdout
    r = subprocess.run([sys.executable, "-m", "appliance", "say", "--socket", str(d.socket), "--voice", "clam",
                        "Hello there."], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unknown voice 'clam'; this box offers: default, calm" in r.stderr


def test_voice_names_over_mqtt(box, service_pipeline):
    d, cfg, lst = box
    rid = _rid("mq")
    lst.publish("say", {"text": "A calm voice.", "voice": "calm", "seed": 4, "id": rid})
    done = lst.wait_event(rid)
    assert done["type"] == "done" and done["voice"] == "calm", done
    assert _same(_played(done), expected_pcm(service_pipeline, "A calm voice.", 4, voice="seed:11"))
    rid = _rid("mq-bad")
    lst.publish("say", {"text": "Hello.", "voice": "clam", "id": rid})
    err = lst.wait_event(rid)
    assert err["code"] == "bad_speaker" and "this box offers: default, calm" in err["message"]


def _silent_seed(pipeline, text: str, params: SynthParams) -> tuple[int, list[int]]:
    """A seed for which some but not all sentences of ``text`` end at their first step (the
    in-process pipeline makes the same codes as the daemon for the same seed)."""
    for seed in range(130, 330):
        run = pipeline.run(pipeline.prepare(SynthesisRequest(text=text, id="probe", seed=seed, params=params)))
        try:
            for _ in run:
                pass
        except EmptyResultError:
            continue
        if run.report.silent:
            return seed, sorted(run.report.silent)
    pytest.fail("no seed in 130..329 makes a sentence end at its first step on the tiny checkpoint")


def test_done_names_the_sentences_that_produced_no_audio(box, service_pipeline):
    d, cfg, _ = box
    text = "One. Two."
    # a flat distribution over every code, so that the end code can be drawn at the first step
    params = {"max_new_tokens": 4, "temperature": 5.0, "top_p": 1.0, "top_k": 626}
    seed, silent = _silent_seed(service_pipeline, text, SynthParams(**params))
    done = d.request({"text": text, "seed": seed, "params": params, "id": _rid("silent")})[-1]
    assert done["type"] == "done", done
    assert done["silent_sentences"] == silent and len(done["spoken"]) == 2
    ok = d.request({"text": "One.", "seed": 1, "params": {"max_new_tokens": 4}, "id": _rid("loud")})[-1]
    assert ok["type"] == "done" and ok["silent_sentences"] == []


def test_empty_text_has_one_wording(box):
    d, cfg, _ = box
    # "" is caught by the dispatcher, a control character (read as a space) by the normalizer
    msgs = {d.request({"text": t, "id": _rid("empty")})[-1]["message"] for t in ("", "   ", "\u0001", "\x00 \t")}
    assert msgs == {"text is empty; send something to speak"}


def test_clearing_a_retained_say_is_not_a_request(box):
    d, cfg, lst = box
    # published retained while the daemon is connected: delivered live (retain flag cleared), spoken
    lst.c.publish(f"{lst.base}/say", b"Left retained.", qos=1, retain=True).wait_for_publish(10)
    lst.wait(lambda m: m.leaf == "event" and m.json().get("type") == "done"
             and m.json().get("spoken") == ["Left retained."], 60, "the retained say spoken")
    n = len(lst.msgs)
    lst.c.publish(f"{lst.base}/say", b"", qos=1, retain=True).wait_for_publish(10)   # clear it, as advised
    rid = _rid("after")                        # QoS 1, one topic: handled after the empty message
    lst.publish("say", {"text": "After the clear.", "id": rid, "params": {"max_new_tokens": 20}})
    assert lst.wait_event(rid)["type"] == "done"
    later = [m.json() for m in lst.msgs[n:] if m.leaf == "event"]
    assert later and all(e.get("id") == rid for e in later), later         # no bad_text, no other event
    assert "ignored an empty message on" in d.log()


def test_the_voice_select_survives_a_restart(tiny_ckpt, tmp_path, mqtt_broker):
    cfg = service_config(tiny_ckpt, tmp_path, health={"at_start": False},
                         service={"spool_dir": str(tmp_path / "spool")}, mqtt=mqtt_section(mqtt_broker))
    cfg["voices"] = VOICES
    lst = Listener(mqtt_broker, f"{cfg['mqtt']['topic_prefix']}/{cfg['mqtt']['device_id']}")
    try:
        d = launch_daemon(tmp_path / "d1", cfg)
        try:
            lst.wait(lambda m: m.leaf == "voice" and m.payload == b"default", 60, "voice state default")
            lst.publish("voice/set", "calm")
            lst.wait(lambda m: m.leaf == "voice" and m.payload == b"calm", 30, "voice state calm")
        finally:
            assert d.stop() == 0, d.log()[-3000:]
        assert (tmp_path / "spool" / "voice-select").read_text().strip() == "calm"
        t0 = time.monotonic()
        d = launch_daemon(tmp_path / "d2", cfg)
        try:
            lst.wait(lambda m: m.at >= t0 and m.leaf == "availability" and m.payload == b"online", 60, "online")
            lst.wait(lambda m: m.at >= t0 and m.leaf == "voice", 30, "voice state after the restart")
            rid = _rid("sel")
            lst.publish("say", {"text": "Which voice?", "id": rid, "params": {"max_new_tokens": 20}})
            done = lst.wait_event(rid)
            assert done["type"] == "done" and done["voice"] == "calm", done
            states = [m.payload for m in lst.msgs if m.at >= t0 and m.leaf == "voice"]
            assert states and set(states) == {b"calm"}, states                # never reset to the first voice
            assert "the voice select's last choice" in d.log()
        finally:
            assert d.stop() == 0, d.log()[-3000:]
    finally:
        lst.close()
