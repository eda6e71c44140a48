"""The Wyoming server of the real daemon against malformed events, spoken to by the real ``wyoming``
client (``AsyncTcpClient`` / ``AsyncUnixClient``; raw bytes where the library cannot write the
fault): every bad event is answered with an ``error`` in plain words before anything is queued and
the connection goes on; an error inside a stream comes before its ``synthesize-stopped``; an event
over ``wyoming.max_payload_bytes`` (300 MB announced) is refused and its connection closed without
the daemon reading or allocating it (its peak RSS, ``VmHWM``, stays put)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Optional

import pytest
from wyoming.client import AsyncClient, AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event, async_read_event
from wyoming.info import Describe, Info
from wyoming.ping import Ping
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop

from tests.fixtures_service import launch_daemon
from tests.test_wyoming_daemon import _wait_listening, _wy_config

MAX_PAYLOAD = 4096
PYTHON_TALK = re.compile(r"Traceback|concatenate|NoneType|object has no|not subscriptable|KeyError|TypeError|"
                         r"AttributeError|ValueError|unsupported operand|argument of type|<class")
"""What a Python exception string looks like: never in an error event's text."""


@pytest.fixture(scope="module")
def wy(tiny_ckpt, tmp_path_factory):
    """One daemon (Wyoming on TCP and a UNIX socket, data + payload limit 4096 bytes) for the module."""
    tmp = tmp_path_factory.mktemp("wy_hard")
    cfg = _wy_config(tiny_ckpt, tmp, max_payload_bytes=MAX_PAYLOAD)
    cfg["synthesis"] = {**cfg["synthesis"], "max_new_tokens": 24, "min_new_tokens": 24}
    d = launch_daemon(tmp / "d", cfg)
    _wait_listening(cfg["wyoming"]["uris"], d)
    yield d
    assert d.stop() == 0, d.log()[-3000:]
    assert "Traceback" not in d.log(), d.log()[-3000:]


def _uris(d) -> tuple[str, str]:
    tcp, unix = d.config["wyoming"]["uris"]
    return tcp, unix


async def _read_until(c: AsyncClient, until: tuple, timeout_s: float = 60.0) -> list[Event]:
    """Events up to the first whose type is in ``until``, or up to EOF (then an ``<eof>`` event)."""
    got: list[Event] = []
    while True:
        ev = await asyncio.wait_for(c.read_event(), timeout_s)
        got.append(ev if ev is not None else Event(type="<eof>"))
        if ev is None or ev.type in until:
            return got


def _check_error(ev: Event, code: str = "bad_request", words: Optional[str] = None) -> Error:
    assert ev.type == "error", ev
    err = Error.from_event(ev)
    assert err.code == code, err
    assert not PYTHON_TALK.search(err.text), err.text          # plain words, no exception strings
    if words is not None:
        assert words in err.text, err.text
    return err


def _pcm(evs: list[Event]) -> bytes:
    return b"".join(e.payload or b"" for e in evs if e.type == "audio-chunk")


def _speaks(d) -> int:
    return d.log().count(": speak wy-")


# events the wyoming library can write, each with words its error must hold
BAD_EVENTS = [
    (Event(type="synthesize", data={"text": 5}), "'text' must be a text, not the number 5"),
    (Event(type="synthesize", data={"text": None}), "'text' must be a text"),
    (Event(type="synthesize", data={"text": ["a", "b"]}), "not a list"),
    (Event(type="synthesize", data={"txt": "hello"}), "'text' must be a text"),
    (Event(type="synthesize", data={"text": "hello", "voice": "calm"}), "'voice' must be an object"),
    (Event(type="synthesize", data={"text": "hello", "voice": {"name": 5}}), "voice name must be a text"),
    (Event(type="synthesize", data={"text": "hello", "voice": [1]}), "'voice' must be an object"),
    (Event(type="synthesize", data={"text": "hello", "text_format": 3}), "'text_format' must be 'text' or 'ssml'"),
    (Event(type="synthesize-chunk", data={"text": "no start"}), "synthesize-chunk without synthesize-start"),
    (Event(type="ping", data={"text": {"a": 1}}), "ping's 'text' must be a text"),
    (Event(type="select-program", data={"name": "piper"}), "one program is 'chattts-appliance'"),
    (Event(type="Synthesize"), "'type' must be a name"),
    (Event(type="synthesize now"), "'type' must be a name"),
]

# faults only raw bytes can carry: (bytes, words of the error)
BAD_BYTES = [
    (b'{"type": "synthesize", "data": {"text": "\\ud800"}}\n', "lone UTF-16 surrogate"),
    (b'{"type": "synthesize", "data": {"text": "\xff\xfe"}}\n', "not valid UTF-8"),
    (b"{not json\n", "not valid JSON"),
    (b"[1, 2, 3]\n", "must be a JSON object, not a list"),
    (b'{"type": "synthesize", "data": [1]}\n', "'data' must be a JSON object"),
    (b'{"type": 5}\n', "'type' must be a name"),
    (b'{"data": {"text": "hi"}}\n', "no 'type'"),
    (b'{"type": "synthesize", "data_length": 4}\n[12]', "data part must be a JSON object"),
    (b'{"type": "synthesize", "data_length": 6}\n{"te"}', "data part is not valid JSON"),
]


@pytest.mark.parametrize("uri_kind", ["tcp", "unix"])
def test_every_malformed_event_gets_an_error_and_the_connection_goes_on(wy, uri_kind):
    """Each bad event: one ``error`` in plain words, nothing queued (no audio-start/stop, no speak
    request), then a ``describe`` on the same connection is answered."""
    uri = _uris(wy)[0 if uri_kind == "tcp" else 1]
    speaks = _speaks(wy)

    async def go() -> None:
        async with AsyncClient.from_uri(uri) as c:
            for ev, words in BAD_EVENTS:
                await c.write_event(ev)
                await c.write_event(Describe().event())
                got = await _read_until(c, ("info",))
                assert [e.type for e in got] == ["error", "info"], (ev, got)
                _check_error(got[0], words=words)
            for raw, words in BAD_BYTES:
                c._writer.write(raw)          # the library cannot write these: its own writer, raw
                await c.write_event(Describe().event())
                got = await _read_until(c, ("info",))
                assert [e.type for e in got] == ["error", "info"], (raw, got)
                _check_error(got[0], words=words)
            # an unknown but well-formed type is dropped, as the protocol asks servers to do
            await c.write_event(Event(type="some-future-event", data={"x": 1}))
            await c.write_event(Describe().event())
            assert [e.type for e in await _read_until(c, ("info",))] == ["info"]

    asyncio.run(go())
    assert _speaks(wy) == speaks, wy.log()[-2000:]          # nothing was handed to the dispatcher


def test_text_5_is_refused_before_anything_is_queued_and_speaking_goes_on(wy):
    """The reported case: ``{"type": "synthesize", "data": {"text": 5}}``; afterwards the same
    connection describes and speaks."""
    tcp, _ = _uris(wy)

    async def go() -> list[Event]:
        async with AsyncTcpClient(*tcp[len("tcp://"):].rsplit(":", 1)) as c:
            await c.write_event(Event(type="synthesize", data={"text": 5}))
            got = await _read_until(c, ("error",))
            await c.write_event(Describe().event())
            got += await _read_until(c, ("info",))
            await c.write_event(Synthesize(text="你好。").event())
            return got + await _read_until(c, ("audio-stop", "error"))

    got = asyncio.run(go())
    _check_error(got[0], words="'text' must be a text, not the number 5")
    assert Info.from_event(got[1]).tts[0].name == "chattts-appliance"
    body = [e.type for e in got[2:]]
    assert body[0] == "audio-start" and body[-1] == "audio-stop" and "audio-chunk" in body, body


def test_errors_inside_a_stream_come_before_synthesize_stopped(wy):
    """A bad chunk mid-stream gets its error at once, the stream goes on (its two sentences are
    spoken: twice the audio of one, every sentence being 24 steps here), and synthesize-stopped
    comes last; a malformed synthesize-start answers its stream with an error, then audio-start,
    audio-stop, synthesize-stopped. Then describe and a one-shot on the same connection."""
    _, unix = _uris(wy)

    async def go() -> tuple[list[Event], ...]:
        async with AsyncClient.from_uri(unix) as c:
            for ev in (SynthesizeStart().event(), SynthesizeChunk(text="今天天气").event(),
                       Event(type="synthesize-chunk", data={"text": 5}), SynthesizeChunk(text="很好。再见").event(),
                       Event(type="synthesize-chunk", data={}), SynthesizeChunk(text="。").event(),
                       SynthesizeStop().event()):
                await c.write_event(ev)
            one = await _read_until(c, ("synthesize-stopped",))
            for ev in (Event(type="synthesize-start", data={"voice": "calm"}), SynthesizeChunk(text="不说。").event(),
                       SynthesizeStop().event()):
                await c.write_event(ev)
            two = await _read_until(c, ("synthesize-stopped",))
            await c.write_event(Describe().event())
            await c.write_event(Synthesize(text="你好。").event())
            return one, two, await _read_until(c, ("audio-stop", "error"))

    one, two, three = asyncio.run(go())
    types = [e.type for e in one]
    assert types.count("error") == 2 and types[-1] == "synthesize-stopped", types
    for e in one:
        if e.type == "error":
            _check_error(e, words="synthesize-chunk's 'text' must be a text")
    assert types.index("audio-stop") == len(types) - 2 and "audio-chunk" in types, types
    assert [e.type for e in two] == ["error", "audio-start", "audio-stop", "synthesize-stopped"], two
    _check_error(two[0], words="'voice' must be an object")
    assert [e.type for e in three if e.type != "audio-chunk"] == ["info", "audio-start", "audio-stop"], three
    assert len(_pcm(one)) == 2 * len(_pcm(three)) > 0


def test_an_error_mid_stream_comes_while_the_stream_is_still_open(wy):
    """A stream is ONE request, open until synthesize-stop: the error of a bad chunk sent after its
    first sentence is written among that request's audio at once, not held back until the request
    ends (the client reads it before it sends the rest); the stream then goes on, both sentences
    are spoken, and synthesize-stopped comes last with no second error."""
    _, unix = _uris(wy)
    speaks = _speaks(wy)

    async def go() -> tuple[list[Event], list[Event]]:
        async with AsyncClient.from_uri(unix) as c:
            for ev in (SynthesizeStart().event(), SynthesizeChunk(text="今天天气很好。再").event(),
                       Event(type="synthesize-chunk", data={"text": 5})):
                await c.write_event(ev)
            early = await _read_until(c, ("error",))          # synthesize-stop not sent yet
            for ev in (SynthesizeChunk(text="见。").event(), SynthesizeStop().event()):
                await c.write_event(ev)
            return early, await _read_until(c, ("synthesize-stopped",))

    early, rest = asyncio.run(go())
    _check_error(early[-1], words="synthesize-chunk's 'text' must be a text")
    assert all(e.type in ("audio-start", "audio-chunk") for e in early[:-1]), early
    types = [e.type for e in early + rest]
    assert types.count("error") == 1 and types[-2:] == ["audio-stop", "synthesize-stopped"], types
    assert types.count("audio-start") == 1 and "audio-chunk" in types, types
    assert _speaks(wy) == speaks + 1, wy.log()[-2000:]       # one request for the whole stream


def test_describe_and_ping_inside_a_stream_are_answered_after_it(wy):
    """Nothing comes between an utterance's audio-start and its synthesize-stopped but its audio
    and its errors: a describe and a ping sent inside a stream are answered, in order, right after
    its synthesize-stopped (the connection's one reply queue holds them until the stream ends)."""
    _, unix = _uris(wy)

    async def go() -> list[Event]:
        async with AsyncClient.from_uri(unix) as c:
            for ev in (SynthesizeStart().event(), SynthesizeChunk(text="今天天气很好。").event(), Describe().event(),
                       Ping(text="p1").event(), SynthesizeChunk(text="再见。").event(), SynthesizeStop().event()):
                await c.write_event(ev)
            return await _read_until(c, ("pong",))

    types = [e.type for e in asyncio.run(go()) if e.type != "audio-chunk"]
    assert types == ["audio-start", "audio-stop", "synthesize-stopped", "info", "pong"], types


def test_a_stream_with_an_unknown_voice_is_answered_read_and_the_connection_goes_on(wy):
    """The reported case: a client writes a whole stream (synthesize-start with a voice the box
    lacks, 300 chunks, Home Assistant's synthesize for old servers, synthesize-stop: about 40 KB,
    more than the socket buffers hold) before it reads a byte. It gets the error, then
    audio-start, audio-stop and synthesize-stopped, nothing of the stream is spoken (no request),
    and on the same connection describe is answered and the next stream is spoken."""
    tcp, _ = _uris(wy)
    speaks = _speaks(wy)
    sentence = "This stream names a voice the box does not have. "

    async def go() -> tuple[list[Event], list[Event], list[Event]]:
        async with AsyncClient.from_uri(tcp) as c:
            await c.write_event(Event(type="synthesize-start", data={"voice": {"name": "nobody"}}))
            for _ in range(300):
                await c.write_event(SynthesizeChunk(text=sentence).event())
            await c.write_event(Synthesize(text=sentence * 3, voice=None).event())
            await c.write_event(SynthesizeStop().event())
            refused = await _read_until(c, ("synthesize-stopped",))
            await c.write_event(Describe().event())
            info = await _read_until(c, ("info",))
            for ev in (SynthesizeStart().event(), SynthesizeChunk(text="你好。").event(), SynthesizeStop().event()):
                await c.write_event(ev)
            return refused, info, await _read_until(c, ("synthesize-stopped",))

    refused, info, spoken = asyncio.run(go())
    assert [e.type for e in refused] == ["error", "audio-start", "audio-stop", "synthesize-stopped"], refused
    _check_error(refused[0], code="bad_speaker", words="unknown voice 'nobody'")
    assert [e.type for e in info] == ["info"], info
    types = [e.type for e in spoken]
    assert types[0] == "audio-start" and "audio-chunk" in types and types[-2:] == ["audio-stop", "synthesize-stopped"]
    assert _speaks(wy) == speaks + 1, wy.log()[-2000:]       # only the second stream was spoken


def test_ssml_is_spoken_without_its_tags(wy):
    """``text_format: ssml`` (refused before): a one-shot and a stream are spoken; the request the
    dispatcher gets holds the text with a pause token, not the tags (its length in the log)."""
    _, unix = _uris(wy)
    ssml = '<speak>你好<break time="1s"/>再见。</speak>'      # read as "你好 [lbreak] 再见。": 15 characters

    async def go() -> tuple[list[Event], list[Event]]:
        async with AsyncClient.from_uri(unix) as c:
            await c.write_event(Event(type="synthesize", data={"text": ssml, "text_format": "ssml"}))
            one = await _read_until(c, ("audio-stop", "error"))
            await c.write_event(Event(type="synthesize-start", data={"text_format": "ssml"}))
            for part in (ssml[:9], ssml[9:20], ssml[20:]):     # a tag cut across chunks
                await c.write_event(SynthesizeChunk(text=part).event())
            await c.write_event(SynthesizeStop().event())
            return one, await _read_until(c, ("synthesize-stopped",))

    one, two = asyncio.run(go())
    for got in (one, two):
        types = [e.type for e in got]
        assert "error" not in types and "audio-chunk" in types, types
    assert wy.log().count(": speak wy-") >= 2 and wy.log().count("(15 chars") >= 2, wy.log()[-2000:]


def _vm_hwm_kib(pid: int) -> int:
    """Peak resident set size of ``pid`` (``VmHWM`` in /proc/PID/status), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_an_event_over_the_payload_limit_is_refused_unread(wy):
    """A header announcing 300,000,000 bytes of data, and a real 5 KB synthesize (limit 4096):
    each gets an error naming wyoming.max_payload_bytes and the connection is closed; the daemon's
    peak RSS stays where it was (it read and allocated none of it); a new connection is served."""
    tcp, unix = _uris(wy)
    before = _vm_hwm_kib(wy.proc.pid)

    async def go(uri: str, send) -> list[Event]:
        async with AsyncClient.from_uri(uri) as c:
            await send(c)
            return await _read_until(c, ())                  # to EOF

    async def announce_300mb(c: AsyncClient) -> None:
        header = {"type": "synthesize", "data_length": 300_000_000, "version": "1.10.2"}
        c._writer.write(json.dumps(header).encode() + b"\n")   # announced, not sent: the library would send it
        await c._writer.drain()

    async def big_text(c: AsyncClient) -> None:
        await c.write_event(Synthesize(text="长" * 2000).event())   # 6,000 bytes of UTF-8 data

    for uri, send, size in ((tcp, announce_300mb, "300000000 bytes"), (unix, big_text, "bytes (data 60")):
        got = asyncio.run(go(uri, send))
        assert [e.type for e in got] == ["error", "<eof>"], got
        _check_error(got[0], words=f"limit of {MAX_PAYLOAD} bytes (wyoming.max_payload_bytes)")
        assert size in got[0].data["text"], got[0].data
    after = _vm_hwm_kib(wy.proc.pid)
    assert after - before < 32 * 1024, (before, after)         # 300 MB read would be +293,000 KiB

    async def describe(uri: str) -> list[Event]:
        async with AsyncClient.from_uri(uri) as c:
            await c.write_event(Describe().event())
            return await _read_until(c, ("info",))

    assert [e.type for e in asyncio.run(describe(tcp))] == ["info"]
    assert wy.proc.poll() is None


def test_a_header_line_over_the_line_limit_closes_the_connection(wy):
    """A header line longer than service.max_line_bytes (64 KiB here): error, then EOF."""
    _, unix = _uris(wy)

    async def go() -> list[Optional[Event]]:
        reader, writer = await asyncio.open_unix_connection(unix[len("unix://"):])
        writer.write(b'{"type": "synthesize", "data": {"text": "' + b"a" * 70000 + b'"}}\n')
        await writer.drain()
        got = [await asyncio.wait_for(async_read_event(reader), 30), await asyncio.wait_for(async_read_event(reader), 30)]
        writer.close()
        return got

    err, eof = asyncio.run(go())
    assert eof is None
    _check_error(err, words="longer than 65536 bytes (service.max_line_bytes)")
