"""An utterance is ONE request (the real daemon, the real ``wyoming`` client, the tiny checkpoint):
a 30-sentence streamed answer and a 10,000-character one-shot play in full and in order with no
``busy`` on a channel whose queue holds ONE request; another request on that channel waits behind
the utterance (in the one queue place); an alert still preempts it, and the utterance resumes
from its start (the client gets every sample exactly once)."""

from __future__ import annotations

import asyncio
import time

import pytest
from wyoming.client import AsyncClient
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from appliance.audio.wav import to_int16
from tests.fixtures_mqtt import free_port
from tests.fixtures_service import expected_pcm, service_config
from tests.test_wyoming_daemon import (
    Talk,
    _check_framing,
    _talk,
    _wait_listening,
    same_pcm,
)
from tests.waits import wait_log

SYN = {"max_new_tokens": 8, "min_new_tokens": 8, "seed": 5}      # short sentences: many of them
WORDS = "red blue green gold quick slow brave calm bright dark warm cold".split()


def sentence(i: int) -> str:
    """The i-th of many different English sentences (no digits: normalization keeps them as they are)."""
    ws = []
    for _ in range(4):
        ws.append(WORDS[i % 12])
        i //= 12
    return " ".join(ws + ["birds", "sing", "here"]).capitalize() + "."


SENTS30 = [sentence(i) for i in range(30)]
LONG = []
while sum(len(s) + 1 for s in LONG) < 10_000:
    LONG.append(sentence(1000 + len(LONG)))


@pytest.fixture(scope="module")
def cfg_pipe(tiny_ckpt, tmp_path_factory):
    from appliance.config import config_from_dict
    from appliance.synth.pipeline import Pipeline

    tmp = tmp_path_factory.mktemp("wy_utt")
    cfg = service_config(tiny_ckpt, tmp, synthesis=SYN)
    return Pipeline.from_config(config_from_dict(cfg, base_dir=str(tmp)))


def _pcm16(pipe, sentences: list[str]) -> bytes:
    """One request's audio: sentence k with seed + k."""
    return b"".join(to_int16(expected_pcm(pipe, s, SYN["seed"] + k)).tobytes() for k, s in enumerate(sentences))


@pytest.fixture
def daemon(tiny_ckpt, tmp_path, start_daemon):
    uri = f"tcp://127.0.0.1:{free_port()}"
    cfg = service_config(tiny_ckpt, tmp_path, synthesis=SYN,
                         wyoming={"enabled": True, "uris": [uri], "voices": [{"name": "default", "voice": None}]})
    cfg["service"]["channels"] = [{"name": "main", "queue_len": 1, "on_preempt": "resume"}]
    d = start_daemon(cfg)
    _wait_listening([uri], d)
    return d, uri


def _speak(text: str, rid: str, **kw) -> dict:
    return dict({"type": "speak", "text": text, "id": rid, "channel": "main", "seed": 1}, **kw)


def test_thirty_streamed_sentences_are_one_request_and_others_queue_behind(daemon, cfg_pipe):
    d, uri = daemon

    async def go() -> tuple[Talk, list, list]:
        t = Talk()
        async with AsyncClient.from_uri(uri) as c:
            await c.write_event(SynthesizeStart().event())
            await c.write_event(SynthesizeChunk(text=" ".join(SENTS30) + " ").event())   # an LLM's answer at once
            while (ev := await asyncio.wait_for(c.read_event(), 60)).type != "audio-chunk":
                t.events.append((time.monotonic(), ev))
            t.events.append((time.monotonic(), ev))
            # the stream is still open: another request on its channel waits in the one queue place
            q = d.connect()
            q.send(_speak("Queued behind.", "behind"))
            accepted = q.events(("accepted", "error"))
            full = d.request(_speak("One too many.", "refused"), until=("accepted", "error"))
            await c.write_event(SynthesizeStop().event())
            while (ev := await asyncio.wait_for(c.read_event(), 60)).type != "synthesize-stopped":
                t.events.append((time.monotonic(), ev))
            t.events.append((time.monotonic(), ev))
        ends = q.events(("done", "error"))
        q.close()
        return t, accepted + ends, full

    t, behind, full = asyncio.run(go())
    _check_framing(t, stream=True)
    assert "error" not in t.types
    same_pcm(t.pcm(), _pcm16(cfg_pipe, SENTS30))                       # all 30, in order
    acc = behind[0]
    assert acc["type"] == "accepted" and acc["queue_position"] == 0, behind
    assert "is busy with request wy-" in acc["waiting"], acc
    assert [e["type"] for e in behind] == ["accepted", "started", "done"], behind
    assert full[-1]["type"] == "error" and full[-1]["code"] == "busy", full   # queue_len 1: the utterance + 1
    line = next(x for x in d.log().splitlines() if "synthesized wy-" in x)
    assert "30 sentence(s)" in line, line


def test_a_long_one_shot_plays_in_full_in_order_and_an_alert_still_gets_in(daemon, cfg_pipe):
    d, uri = daemon
    text = " ".join(LONG)
    assert len(text) >= 10_000
    alert = []
    t = asyncio.run(_talk(uri, [Synthesize(text=text).event()], timeout_s=300,
                          on_first_chunk=lambda: alert.append(d.request(_speak("Alert now.", "alert-1", priority="alert")))))
    _check_framing(t, stream=False)
    assert "error" not in t.types
    assert alert[0][-1]["type"] == "done", alert
    wait_log(d.log, "alert alert-1 preempts wy-")
    wait_log(d.log, "resumes on main right after alert-1")
    same_pcm(t.pcm(), _pcm16(cfg_pipe, LONG))                          # every sentence once, in order
    line = next(x for x in d.log().splitlines() if "synthesized wy-" in x)
    assert f"{len(LONG)} sentence(s)" in line, line
