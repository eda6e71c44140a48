"""A client that goes away cancels its request (``on_disconnect: cancel``, the default): the
synthesis stops within a step, unplayed audio is dropped and the next request on the channel
starts at once; a client that only half-closes still gets its answer. Real daemon, real socket,
real ALSA file device."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from tests.fixtures_service import (
    alsa_home,
    expected_pcm,
    launch_daemon,
    resample_like_daemon,
    service_config,
    wait_played,
)
from tests.waits import wait_for


@pytest.fixture(scope="module")
def daemon(tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disc")
    alsa = alsa_home(tmp / "home", tmp / "played.raw")
    cfg = service_config(tiny_ckpt, tmp, audio={"output": "device"},
                         synthesis={"max_new_tokens": 400},
                         service={"channels": [{"name": "main"}]})
    d = launch_daemon(tmp / "d", cfg, alsa=alsa)
    yield d
    assert d.stop() == 0, d.log()[-3000:]


def _status(d) -> dict:
    (ev,) = d.request({"type": "status"})
    return ev["channels"]["main"]


def test_client_gone_cancels_and_the_next_request_starts_at_once(daemon, service_pipeline):
    c = daemon.connect()
    off = daemon.alsa.size()
    c.send({"type": "speak", "text": "这是一个很长的句子，没有人会听完它。", "id": "long-1", "seed": 5,
            "params": {"min_new_tokens": 400, "max_new_tokens": 400}})          # 8.5 s of audio
    evs = c.events(("started", "error"))
    assert evs[-1]["type"] == "started", evs
    wait_for(lambda: np.count_nonzero(daemon.alsa.read(off)), 30, "long-1 being heard")
    c.close()                                           # gone (not a half-close)
    wait_for(lambda: (lambda st: "long-1" not in str(st["active"]) + str(st["playing"]))(_status(daemon)), 10,
             "long-1 cancelled", show=lambda: _status(daemon))
    st = _status(daemon)
    assert st["active"] is None and st["playing"] == [], st
    assert "went away: cancelled long-1 (on_disconnect: cancel)" in daemon.log()
    # the next request on the channel starts at once and plays exactly its own audio
    text, seed = "下一个。", 6
    t0 = time.monotonic()
    evs = daemon.request({"type": "speak", "text": text, "seed": seed, "id": "next-1"})
    assert [e["type"] for e in evs] == ["accepted", "started", "done"], evs
    assert evs[0]["queue_position"] == 0 and evs[0]["waiting"] is None
    assert evs[-1]["ttfb_ms"] < 5000 and time.monotonic() - t0 < 30
    want = resample_like_daemon(expected_pcm(service_pipeline, text, seed), _status(daemon)["rate"])
    played, want = wait_played(daemon.alsa, want)
    assert np.abs(played - want).max() <= 1e-6


def test_half_closed_client_still_gets_its_answer(daemon):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(str(daemon.socket))
    s.sendall(b'{"type":"speak","text":"\\u4f60\\u597d","id":"half-1","seed":1,"params":{"max_new_tokens":40}}\n')
    s.shutdown(socket.SHUT_WR)                          # EOF, but still reading
    buf = b""
    while b'"done"' not in buf and b'"error"' not in buf:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    s.close()
    assert b'"type":"done"' in buf and b'"half-1"' in buf, buf
