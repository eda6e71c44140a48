"""A Wyoming client that stops reading: its connection's audio is bounded by
``wyoming.max_buffered_ms`` (:mod:`appliance.audio.stream`, the one rule for every client), the request that goes over
it is cancelled with the reason in the log, and another client on another connection (same
channel) and a socket request on another channel get their audio. The real daemon, the real
``wyoming`` client; the stalled client is a raw socket with a small receive buffer that never reads.
The bound is checked by the sink's own accounting (the numbers it logs), never by timing."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import numpy as np
import pytest
from wyoming.tts import Synthesize

from appliance.audio.stream import AUDIO, EVENT, ClientStream, Outbox, StreamAudio, ms
from appliance.audio.wav import to_int16
from appliance.errors import CancelledError
from tests.fixtures_service import expected_pcm, service_config
from tests.test_wyoming_daemon import (
    ONE_SHOT,
    SYN,
    _check_framing,
    _wait_listening,
    _wy_config,
    same_pcm,
    talk,
)
from tests.waits import wait_log

BOUND_MS = 2000
"""wyoming.max_buffered_ms of the daemon under test: above the largest chunk (48 steps, 1024 ms),
so the connection never holds more than this."""

OVERFLOW = re.compile(r"wyoming#\d+: request (wy-\S+) was cancelled: its Wyoming client stopped reading its audio "
                      r"\((\d+) ms waiting to be sent, (\d+) ms more would pass wyoming.max_buffered_ms = (\d+)\); "
                      r"(\d+) ms of its audio dropped, connection peak (\d+) ms")


def _items(box: Outbox) -> list:
    return list(box._items)


def test_the_sink_refuses_the_chunk_over_the_bound_and_drops_its_audio():
    """The client stream's accounting alone: chunks are held up to the bound; the one that would go
    over it raises CancelledError, the request's waiting audio leaves the outbox (its events stay),
    and the stream counts what was dropped; a chunk longer than the bound is taken when nothing waits."""
    loop = asyncio.new_event_loop()
    try:
        budget = ClientStream("wyoming#0", "Wyoming client", 1000, "wyoming.max_buffered_ms")   # 24000 samples
        box = Outbox(loop, budget)
        stalled = []
        sink = budget.audio("wy-t-1", box, on_overflow=stalled.append)
        assert isinstance(sink, StreamAudio)
        box.put((EVENT, "started"))
        chunk = np.full(9600, 0.5, np.float32)     # 400 ms
        sink.write(chunk)
        sink.write(chunk)
        assert budget.buffered == 19200 and budget.peak == 19200
        with pytest.raises(CancelledError, match="stopped reading its audio"):
            sink.write(chunk)                        # 1200 ms > 1000 ms
        assert stalled == [sink] and sink.overflowed
        assert [it[0] for it in _items(box)] == [EVENT]                 # its audio is gone, the event stays
        assert budget.buffered == 0 and budget.dropped == 3 * 9600 and budget.peak == 19200
        sink.write(chunk)                            # after the overflow: nothing more is taken
        assert budget.buffered == 0 and len(_items(box)) == 1

        other = budget.audio("wy-t-2", Outbox(loop, budget))
        other.write(np.zeros(36000, np.float32))    # 1500 ms, one chunk, nothing waiting: taken
        assert budget.buffered == 36000 and ms(budget.peak) == 1500
        kind, owner, data, n = other.outbox._items[0]
        assert (kind, owner, data.dtype, data.size, n) == (AUDIO, other, np.float32, 36000, 36000)   # the transport encodes
        other.written(n)                             # the writer wrote it: no longer counted
        assert budget.buffered == 0 and other.first_out_at is not None
        other.abort()
        done = []
        other.finish(done.append)
        assert done == []                            # never after abort
    finally:
        loop.close()


@pytest.fixture(scope="module")
def pipe(tiny_ckpt, tmp_path_factory):
    """The daemon's pipeline (same model and synthesis settings) in the test process."""
    from appliance.config import config_from_dict
    from appliance.synth.pipeline import Pipeline

    tmp = tmp_path_factory.mktemp("wy_slow_pipe")
    return Pipeline.from_config(config_from_dict(service_config(tiny_ckpt, tmp, synthesis=SYN), base_dir=str(tmp)))


@pytest.fixture
def wy(tiny_ckpt, tmp_path, start_daemon):
    """A daemon with wyoming.max_buffered_ms = BOUND_MS, channels main (Wyoming's) and other."""
    cfg = _wy_config(tiny_ckpt, tmp_path, max_buffered_ms=BOUND_MS)
    cfg["service"]["channels"] = [{"name": "main"}, {"name": "other"}]
    d = start_daemon(cfg)
    _wait_listening(cfg["wyoming"]["uris"], d)
    return d


def _stalled_client(uri: str, text: str) -> socket.socket:
    """A TCP connection that sends one ``synthesize`` and never reads (a 4 KiB receive buffer, so
    the kernel holds little of what the daemon sends)."""
    host, port = uri[len("tcp://"):].rsplit(":", 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(json.dumps({"type": "synthesize", "data": {"text": text}}).encode() + b"\n")
    return s


def test_a_client_that_stops_reading_has_its_request_ended_within_the_bound(wy, pipe):
    d = wy
    tcp = d.config["wyoming"]["uris"][0]

    stalled = _stalled_client(tcp, ONE_SHOT)        # six sentences, ~30 s of audio: far over the bound
    try:
        rid = re.search(r": speak (wy-\S+) ", wait_log(d.log, ": speak wy-", alive=d.alive)).group(1)
        # another client on another connection, same channel: its request waits behind the stalled
        # one, so its audio arrives only because that one ended
        t = talk(tcp, Synthesize(text="仍然在说话。").event())
        _check_framing(t, stream=False)
        want = to_int16(expected_pcm(pipe, "仍然在说话。", SYN["seed"])).tobytes()
        same_pcm(t.pcm(), want)
        # a socket request on the other channel: the worker serves it too
        assert d.request({"type": "speak", "text": "Socket still fine.", "seed": 1, "channel": "other"})[-1]["type"] == "done"

        log = wait_log(d.log, f"request {rid} ended with cancelled", alive=d.alive)
        m = OVERFLOW.search(log)
        assert m is not None and m.group(1) == rid, log[-3000:]
        waiting, more, limit, dropped, peak = (int(m.group(k)) for k in (2, 3, 4, 5, 6))
        assert limit == BOUND_MS
        assert waiting <= BOUND_MS and peak <= BOUND_MS, m.group(0)      # never held more than the bound
        assert waiting + more > BOUND_MS, m.group(0)                      # refused at the bound, not before
        assert dropped > 0, m.group(0)
        assert f"request {rid} ended with cancelled: request {rid} was cancelled: its Wyoming client stopped " \
               f"reading" in log
        # ended: neither synthesizing nor playing; the daemon is fine
        st = d.request({"type": "status"})[-1]["channels"]["main"]
        assert st["active"] != rid and rid not in st["playing"], st
        assert "Traceback" not in d.log()
    finally:
        stalled.close()
    t = talk(tcp, Synthesize(text="你好。").event())                      # still serving
    _check_framing(t, stream=False)
