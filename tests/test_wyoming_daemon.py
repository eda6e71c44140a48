"""The Wyoming TTS server of the real daemon, spoken to by the real ``wyoming`` client library over
TCP and a UNIX socket: describe, one-shot synthesize, streamed text split mid-word, errors,
disconnects, routing to a channel, zeroconf; the PCM is compared with the pipeline's for the
same seed and voice."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
from wyoming.audio import AudioChunk, AudioStart
from wyoming.client import AsyncClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info
from wyoming.ping import Ping
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeVoice,
)

from appliance.audio.wav import read_wav, to_int16
from tests.fixtures_mqtt import free_port
from tests.fixtures_service import ROOT, expected_pcm, launch_daemon, service_config
from tests.waits import wait_for, wait_log

SYN = {"max_new_tokens": 240, "min_new_tokens": 240, "seed": 5}   # every sentence 240 steps (5.1 s)
VOICES = [{"name": "default", "voice": None, "description": ""},
          {"name": "calm", "voice": "seed:11", "description": "a calm voice"}]

# one-shot: six sentences (~1,400 decode steps) so synthesis is still running at the first chunk
ONE_SHOT = "你好。今天天气很好。我们去公园散步吧。The time is 9:30. It is 21 degrees outside. 再见。"
# streamed: pieces cut inside words and numbers; the sentences they make up
STREAM = ["Hel", "lo the", "re. The ti", "me is 9", ".30 n", "ow. 我们去公", "园散步吧", "！Bye"]
STREAM_SENTENCES = ["Hello there.", "The time is 9.30 now.", "我们去公园散步吧！", "Bye"]


def _wy_config(tiny_ckpt, tmp: Path, **wyoming) -> dict:
    port = free_port()
    wy = {"enabled": True, "uris": [f"tcp://127.0.0.1:{port}", f"unix://{tmp}/run/wyoming.sock"], "voices": VOICES}
    wy.update(wyoming)
    return service_config(tiny_ckpt, tmp, synthesis=SYN, wyoming=wy)


def _wait_listening(uris: list[str], d, timeout_s: float = 60.0) -> None:
    """Until every Wyoming URI accepts a connection. The daemon's main socket (what
    ``start_daemon`` waits for) is bound first; the Wyoming listeners start after the journal's
    replay, a moment later (a test that talked at once was refused now and then)."""
    deadline = time.monotonic() + timeout_s
    for uri in uris:
        while True:
            try:
                if uri.startswith("tcp://"):
                    host, port = uri[len("tcp://"):].rsplit(":", 1)
                    socket.create_connection((host, int(port)), timeout=1.0).close()
                else:
                    with socket.socket(socket.AF_UNIX) as s:
                        s.settimeout(1.0)
                        s.connect(uri[len("unix://"):])
                break
            except OSError:
                if d.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Wyoming {uri} not accepting:\n{d.log()[-3000:]}")
                time.sleep(0.05)


@pytest.fixture
def start_daemon(start_daemon):
    """The shared factory, then every Wyoming URI of the config listening."""
    def start(cfg: dict, **kw):
        d = start_daemon(cfg, **kw)
        if cfg.get("wyoming", {}).get("enabled"):
            _wait_listening(cfg["wyoming"]["uris"], d)
        return d
    return start


@pytest.fixture(scope="module")
def wy_pipeline(tiny_ckpt, tmp_path_factory):
    """The daemon's pipeline (same model and synthesis settings) in the test process."""
    from appliance.config import config_from_dict
    from appliance.synth.pipeline import Pipeline

    tmp = tmp_path_factory.mktemp("wy_pipe")
    return Pipeline.from_config(config_from_dict(service_config(tiny_ckpt, tmp, synthesis=SYN), base_dir=str(tmp)))


def _pcm16(pipeline, sentences: list[str], voice: Optional[str] = None, seed: int = SYN["seed"]) -> bytes:
    """The int16 PCM the daemon must send for ONE utterance made of these sentences: sentence
    ``k`` is spoken with the request's seed + k (as the sentences of any one request are)."""
    return b"".join(to_int16(expected_pcm(pipeline, s, seed + k, voice)).tobytes() for k, s in enumerate(sentences))


def same_pcm(got: bytes, want: bytes) -> None:
    """The same int16 audio: equal length, at most 1 LSB apart. The sentences of one request are
    vocoded in chunks whose size follows the machine's speed (synth/schedule.py), and a different
    window width rounds float32 differently (|diff| ~1e-8, in-process), which flips an int16 sample
    now and then; wrong, missing or reordered audio differs grossly."""
    a, b = np.frombuffer(got, "<i2").astype(np.int32), np.frombuffer(want, "<i2").astype(np.int32)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.size == 0 or np.abs(a - b).max() <= 1, (np.abs(a - b).max(), int(np.argmax(np.abs(a - b))))


class Talk:
    """What a Wyoming conversation returned: events with arrival times, and the PCM."""

    def __init__(self) -> None:
        self.events: list[tuple[float, Event]] = []

    @property
    def types(self) -> list[str]:
        return [e.type for _, e in self.events]

    def pcm(self) -> bytes:
        return b"".join(e.payload or b"" for _, e in self.events if AudioChunk.is_type(e.type))

    def chunks(self) -> list[AudioChunk]:
        return [AudioChunk.from_event(e) for _, e in self.events if AudioChunk.is_type(e.type)]


async def _talk(uri: str, send: list[Event], until: tuple = ("audio-stop", "error"),
                on_first_chunk: Optional[Callable[[], None]] = None, close_after_first_chunk: bool = False,
                timeout_s: float = 120.0) -> Talk:
    t = Talk()
    async with AsyncClient.from_uri(uri) as c:
        for ev in send:
            await c.write_event(ev)
        while True:
            ev = await asyncio.wait_for(c.read_event(), timeout_s)
            if ev is None:
                t.events.append((time.monotonic(), Event(type="<eof>")))
                return t
            t.events.append((time.monotonic(), ev))
            if AudioChunk.is_type(ev.type) and sum(AudioChunk.is_type(e.type) for _, e in t.events) == 1:
                if on_first_chunk is not None:
                    on_first_chunk()
                if close_after_first_chunk:
                    return t
            if ev.type in until:
                return t


def talk(uri: str, *send: Event, **kw) -> Talk:
    return asyncio.run(_talk(uri, list(send), **kw))


def _check_framing(t: Talk, stream: bool) -> None:
    """audio-start, then audio-chunks (24000 Hz, 16-bit, mono), audio-stop [, synthesize-stopped]."""
    body = [x for x in t.types if x != "audio-chunk"]
    assert body == (["audio-start", "audio-stop", "synthesize-stopped"] if stream else ["audio-start", "audio-stop"]), t.types
    assert t.types.index("audio-start") < t.types.index("audio-chunk") < t.types.index("audio-stop")
    start = AudioStart.from_event(next(e for _, e in t.events if AudioStart.is_type(e.type)))
    assert (start.rate, start.width, start.channels) == (24000, 2, 1)
    assert {(c.rate, c.width, c.channels) for c in t.chunks()} == {(24000, 2, 1)}


def test_describe_one_shot_and_stream_over_tcp_and_unix(tiny_ckpt, tmp_path, start_daemon, wy_pipeline):
    cfg = _wy_config(tiny_ckpt, tmp_path)
    d = start_daemon(cfg)
    tcp, unix = cfg["wyoming"]["uris"]

    # describe: one TTS program, its voices, zh + en, ChatTTS and the CC BY-NC weights named, streaming
    for uri in (tcp, unix):
        t = talk(uri, Describe().event(), until=("info",))
        info = Info.from_event(t.events[-1][1])
        (prog,) = info.tts
        assert prog.name == "chattts-appliance" and prog.installed and prog.supports_synthesize_streaming
        assert [v.name for v in prog.voices] == ["default", "calm"]
        assert all(v.languages == ["zh", "en"] and v.installed for v in prog.voices)
        assert prog.voices[1].description == "a calm voice"
        assert "ChatTTS" in prog.attribution.name and "CC BY-NC 4.0" in prog.attribution.name
        assert "CC BY-NC 4.0" in prog.description
    t = talk(tcp, Ping(text="x").event(), until=("pong",))
    assert t.events[-1][1].data["text"] == "x"

    # one-shot synthesize: chunks as they are produced (synthesis still runs at the first one)
    active_at_first_chunk = []
    t = talk(tcp, Synthesize(text=ONE_SHOT).event(),
             on_first_chunk=lambda: active_at_first_chunk.append(d.request({"type": "status"})[-1]))
    _check_framing(t, stream=False)
    st = active_at_first_chunk[0]["channels"]["main"]
    assert st["active"] is not None and st["active"].startswith("wy-"), st     # the request still synthesizes
    assert len(t.chunks()) > 6
    same_pcm(t.pcm(), _pcm16(wy_pipeline, [ONE_SHOT]))

    # streamed text cut mid-word, with the compatibility 'synthesize' Home Assistant sends in a stream
    t = talk(unix, SynthesizeStart(voice=SynthesizeVoice(name="calm")).event(),
             *[SynthesizeChunk(text=p).event() for p in STREAM],
             Synthesize(text="".join(STREAM), voice=SynthesizeVoice(name="calm")).event(),
             SynthesizeStop().event(), until=("synthesize-stopped", "error"))
    _check_framing(t, stream=True)
    same_pcm(t.pcm(), _pcm16(wy_pipeline, STREAM_SENTENCES, "seed:11"))

    # the audio went only to the client: nothing played or written on the box
    assert not list(Path(cfg["audio"]["wav_dir"]).glob("*.wav"))
    assert "audio to the client only" in d.log()


def test_sentences_are_spoken_while_the_text_still_streams(tiny_ckpt, tmp_path, start_daemon, wy_pipeline):
    """The first sentence's audio arrives before the client has sent the rest of the text."""
    cfg = _wy_config(tiny_ckpt, tmp_path)
    start_daemon(cfg)
    tcp = cfg["wyoming"]["uris"][0]

    async def go() -> Talk:
        t = Talk()
        async with AsyncClient.from_uri(tcp) as c:
            await c.write_event(SynthesizeStart().event())
            for p in ("今天天气", "很好。我们"):
                await c.write_event(SynthesizeChunk(text=p).event())
            while True:                                    # audio of sentence 1 while the stream is open
                ev = await asyncio.wait_for(c.read_event(), 60)
                t.events.append((time.monotonic(), ev))
                if AudioChunk.is_type(ev.type):
                    break
            await c.write_event(SynthesizeChunk(text="去公园散步吧。").event())
            await c.write_event(SynthesizeStop().event())
            while not t.events or t.events[-1][1].type != "synthesize-stopped":
                t.events.append((time.monotonic(), await asyncio.wait_for(c.read_event(), 60)))
        return t

    t = asyncio.run(go())
    _check_framing(t, stream=True)
    same_pcm(t.pcm(), _pcm16(wy_pipeline, ["今天天气很好。", "我们去公园散步吧。"]))


def test_disconnect_cancels_and_errors_disturb_nobody(tiny_ckpt, tmp_path, start_daemon, wy_pipeline):
    cfg = _wy_config(tiny_ckpt, tmp_path)
    d = start_daemon(cfg)
    tcp, unix = cfg["wyoming"]["uris"]

    # a client leaves mid-stream, after its first audio: its utterance (one request) is cancelled
    t = talk(tcp, SynthesizeStart().event(), SynthesizeChunk(text="第一句话。第二句话。第三句").event(),
             close_after_first_chunk=True)
    assert t.types[-1] == "audio-chunk"
    wait_log(d.log, "disconnected: cancelling wy-")
    line = next(x for x in d.log().splitlines() if "disconnected: cancelling" in x)
    ids = line.split("cancelling ")[1].split(", ")
    assert len(ids) == 1, line                                        # the utterance: one request
    for rid in ids:
        wait_log(d.log, f"request {rid} ended with cancelled")
    deadline = time.monotonic() + 20
    while d.request({"type": "status"})[-1]["channels"]["main"]["active"] is not None:
        assert time.monotonic() < deadline
        time.sleep(0.1)

    # a 60,000-character one-shot whose client closes at once: it stops being prepared (normalized)
    # at its next sentence instead of all ~200 of them, and its one request is cancelled
    async def send_and_close() -> None:
        async with AsyncClient.from_uri(tcp) as c:
            await c.write_event(Synthesize(text="Red blue birds sing here. " * 2400).event())

    asyncio.run(send_and_close())
    wait_log(d.log, "the client left; ")
    left, total = map(int, re.search(r"the client left; (\d+) of (\d+) sentences not prepared", d.log()).groups())
    assert total >= 200 and left > total // 2, (left, total)
    wait_log(d.log, "disconnected: cancelling wy-")
    rid = d.log().split("disconnected: cancelling ")[-1].split()[0]
    wait_log(d.log, f"request {rid} ended with cancelled")

    # errors come back as Wyoming 'error' events with our codes ...
    t = talk(unix, Synthesize(text="hi", voice=SynthesizeVoice(name="nobody")).event(), until=("error",))
    err = Error.from_event(t.events[-1][1])
    assert err.code == "bad_speaker" and "calm" in err.text
    t = talk(unix, Synthesize(text="。。。").event(), until=("<eof>",))
    assert [x for x in t.types] == ["error", "<eof>"], t.types              # a failed one-shot ends the conversation
    assert Error.from_event(t.events[0][1]).code == "bad_text"
    t = talk(unix, SynthesizeChunk(text="no start").event(), Event(type="no-such-event"), Describe().event(),
             until=("info",))
    assert t.types == ["error", "info"] and Error.from_event(t.events[0][1]).code == "bad_request"
    t = talk(unix, Event(type="synthesize", data={"no": "text"}), Describe().event(), until=("info",))
    assert t.types[0] == "error" and Error.from_event(t.events[0][1]).code == "bad_request"

    # ... while another client's synthesis goes on undisturbed, and so does the socket
    async def both() -> Talk:
        good = asyncio.create_task(_talk(tcp, [Synthesize(text="仍然在说话。").event()]))
        reader, writer = await asyncio.open_unix_connection(unix[len("unix://"):])
        writer.write(b'{"type": "synthesize", "data_length": 1000000000}\n')   # over the limit: dropped
        await writer.drain()
        assert b"wyoming.max_payload_bytes" in await asyncio.wait_for(reader.read(), 30)   # the error, then EOF
        writer.close()
        return await good

    t = asyncio.run(both())
    _check_framing(t, stream=False)
    same_pcm(t.pcm(), _pcm16(wy_pipeline, ["仍然在说话。"]))
    assert d.request({"type": "speak", "text": "Socket still fine.", "seed": 1})[-1]["type"] == "done"
    assert d.proc.poll() is None


def test_play_routes_to_the_channel_and_streaming_off_still_answers(tiny_ckpt, tmp_path, start_daemon, wy_pipeline):
    cfg = _wy_config(tiny_ckpt, tmp_path, play=True, streaming=False, priority="background")
    d = start_daemon(cfg)
    tcp = cfg["wyoming"]["uris"][0]
    t = talk(tcp, Describe().event(), until=("info",))
    assert Info.from_event(t.events[-1][1]).tts[0].supports_synthesize_streaming is False
    # streaming off: the text is collected and spoken at synthesize-stop, and every event is answered
    t = talk(tcp, SynthesizeStart().event(), *[SynthesizeChunk(text=p).event() for p in STREAM],
             SynthesizeStop().event(), until=("synthesize-stopped", "error"))
    _check_framing(t, stream=True)
    same_pcm(t.pcm(), _pcm16(wy_pipeline, STREAM_SENTENCES))
    # play: true: the same audio was also written on the box (audio.output wav here)
    wavs = sorted(Path(cfg["audio"]["wav_dir"]).glob("wy-*.wav"))
    assert len(wavs) == 1                                     # one utterance, one request, one file
    assert to_int16(read_wav(wavs[0])[0]).tobytes() == t.pcm()
    assert "priority background, also played here" in d.log()


def test_zeroconf_advertises_the_tcp_port(tiny_ckpt, tmp_path, start_daemon):
    pytest.importorskip("zeroconf")
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

    async def resolve(name: str, timeout_ms: int = 5000) -> Optional[AsyncServiceInfo]:
        zc = AsyncZeroconf()
        try:
            info = AsyncServiceInfo("_wyoming._tcp.local.", f"{name}._wyoming._tcp.local.")
            return info if await info.async_request(zc.zeroconf, timeout_ms) else None
        finally:
            await zc.async_close()

    async def probe() -> bool:     # does mDNS work on this machine at all?
        zc = AsyncZeroconf()
        info = AsyncServiceInfo("_wyoming._tcp.local.", "probe._wyoming._tcp.local.", port=1,
                                addresses=[socket.inet_aton("127.0.0.1")])
        try:
            await zc.async_register_service(info)
            return await resolve("probe", 2000) is not None
        finally:
            await zc.async_close()

    if not asyncio.run(probe()):
        pytest.skip("mDNS multicast does not work on this machine")
    name = f"chattts-test-{free_port()}"
    cfg = _wy_config(tiny_ckpt, tmp_path, zeroconf=True, zeroconf_name=name)
    d = start_daemon(cfg)
    port = int(cfg["wyoming"]["uris"][0].rsplit(":", 1)[1])
    info = asyncio.run(resolve(name))
    assert info is not None and info.port == port and "127.0.0.1" in info.parsed_addresses(), d.log()[-2000:]
    d.stop()
    assert asyncio.run(resolve(name, 1500)) is None                 # withdrawn at stop


def test_zeroconf_warns_when_it_advertises_a_loopback_address(tiny_ckpt, tmp_path, start_daemon, caplog):
    """The shipped config.local.yaml listens on tcp://127.0.0.1:10200: advertised as is, Home
    Assistant on another machine finds the box and cannot connect. The daemon says so, and how to
    listen on the LAN (whether or not mDNS works here: the warning comes before registering)."""
    pytest.importorskip("zeroconf")
    from appliance.transports.wyoming_server import warn_loopback

    assert warn_loopback("127.0.0.1", 10200, "127.0.0.1") and warn_loopback("::1", 10200, "::1")
    assert "a loopback address" in caplog.text and "tcp://0.0.0.0:10200" in caplog.text
    caplog.clear()
    assert not warn_loopback("192.168.1.20", 10200, "0.0.0.0") and not caplog.text
    cfg = _wy_config(tiny_ckpt, tmp_path, zeroconf=True, zeroconf_name=f"chattts-lo-{free_port()}")
    port = int(cfg["wyoming"]["uris"][0].rsplit(":", 1)[1])
    d = start_daemon(cfg)
    want = f"advertising 127.0.0.1:{port}, a loopback address (wyoming.uris listens on 127.0.0.1)"
    wait_log(d.log, want, 60)
    assert f'set wyoming.uris to ["tcp://0.0.0.0:{port}"]' in d.log()


def test_a_taken_port_is_in_health_and_listened_on_once_free(tiny_ckpt, tmp_path):
    """A Wyoming port another program holds does not stop the box: health names it (the socket
    serves), and the daemon listens on it once it is free."""
    cfg = _wy_config(tiny_ckpt, tmp_path)
    port = int(cfg["wyoming"]["uris"][0].rsplit(":", 1)[1])
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(1)
    d = launch_daemon(tmp_path / "d", cfg)
    try:
        st = wait_for(lambda: (lambda st: any(c["name"] == "wyoming" for c in st["conditions"]) and st)(
            d.request({"type": "status"})[-1]), 30, "the wyoming condition")
        conds = {c["name"]: c["reason"] for c in st["conditions"]}
        assert st["health"] == "degraded" and "the port is in use" in conds["wyoming"], st
        assert f"tcp://127.0.0.1:{port}" in conds["wyoming"]
        s.close()
        wait_for(lambda: not any(c["name"] == "wyoming" for c in d.request({"type": "status"})[-1]["conditions"]),
                 30, "the wyoming condition cleared")
        t = talk(cfg["wyoming"]["uris"][0], Describe().event(), until=("info",))
        assert t.types[-1] == "info"
    finally:
        s.close()
        assert d.stop() == 0, d.log()[-3000:]


def test_wyoming_config_errors_name_the_key(tmp_path):
    from appliance.config import config_from_dict
    from appliance.errors import ConfigError

    for wy, msg in (({"uris": ["tcp://host"]}, "wyoming.uris"), ({"channel": "cabin"}, "wyoming.channel"),
                    ({"voices": [{"name": "a"}, {"name": "a"}]}, "wyoming.voices"),
                    ({"priority": "urgent"}, "wyoming.priority")):
        with pytest.raises(ConfigError, match=msg):
            config_from_dict({"wyoming": wy})


def test_say_does_not_import_wyoming():
    """The clients stay light: the daemon imports the wyoming package only when it is enabled."""
    code = ("import sys, appliance.cli.say, appliance.cli.control, appliance.cli.client; "
            "print('wyoming' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr


def test_audio_only_for_the_client_needs_return_audio_and_is_not_spooled(tmp_path):
    """``play: false`` (how the Wyoming server speaks) needs ``return_audio``, and such a request
    is not spooled at stop: its audio could only have gone back to a connection that is gone."""
    from appliance.errors import RequestError
    from appliance.messages.protocol import parse_request
    from appliance.service.recovery import tell_stopped
    from appliance.service.request import Request as Item

    with pytest.raises(RequestError, match="'play' is false without 'return_audio'"):
        parse_request({"text": "hi", "play": False})
    got = []
    # the dispatcher journals only requests that play (journal number 1 here); see test_journal.py
    items = [Item(speak=parse_request({"text": "kept", "id": "a"}), job=None, channel="main", sink=lambda e: got.append(e),
                  journal=1),
             Item(speak=parse_request({"text": "gone", "id": "b", "play": False, "return_audio": True}), job=None,
                  channel="main", sink=lambda e: got.append(e))]
    tell_stopped(items, journal_on=True)
    assert [(e.id, e.code) for e in got] == [("a", "spooled"), ("b", "cancelled")]
    assert "would only go back to this connection" in got[1].message
