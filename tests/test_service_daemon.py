"""The real daemon on a real UNIX socket, playing through sounddevice -> PortAudio -> ALSA into
a file (tests/asound); what was played is compared with the pipeline's own output."""

from __future__ import annotations

import os
import stat
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


@pytest.fixture(scope="module")
def dev_daemon(tiny_ckpt, tmp_path_factory):
    """One daemon with audio.output=device on the ALSA file device, for the whole module."""
    tmp = tmp_path_factory.mktemp("svc_dev")
    alsa = alsa_home(tmp / "home", tmp / "played.raw")
    # on_disconnect: finish — a client that leaves does not cancel here (cancel, the default, is
    # tested in test_service_disconnect.py)
    cfg = service_config(tiny_ckpt, tmp, audio={"output": "device"},
                         service={"max_line_bytes": 4096, "socket_mode": 0o660,
                                  "channels": [{"name": "main", "on_disconnect": "finish"}]})
    d = launch_daemon(tmp / "d", cfg, alsa=alsa)
    yield d
    rc = d.stop()
    assert rc == 0, d.log()[-4000:]
    assert "stopped" in d.log()


def _status(d) -> dict:
    (ev,) = d.request({"type": "status"})
    assert ev["type"] == "status"
    return ev


def _device_rate(d) -> int:
    st = _status(d)["channels"]["main"]
    assert st["output"] == "device" and st["ok"], st
    return st["rate"]


def _assert_plays(d, service_pipeline, text: str, seed: int, voice=None) -> dict:
    """Speak over the socket; the ALSA file must then hold exactly the pipeline's PCM."""
    req = {"type": "speak", "text": text, "seed": seed, "id": f"t{seed}-{time.monotonic_ns()}"}
    if voice is not None:
        req["voice"] = voice
    evs = d.request(req)
    assert [e["type"] for e in evs] == ["accepted", "started", "done"], evs
    done = evs[-1]
    assert done["id"] == req["id"] and done["seed"] == seed and done["output"].startswith("device:")
    assert done["ttfb_ms"] > 0 and done["rtf"] > 0 and done["steps"] > 0
    want = resample_like_daemon(expected_pcm(service_pipeline, text, seed, voice), _device_rate(d))
    played, want = wait_played(d.alsa, want)
    err = np.abs(played - want)
    assert err.max() <= 1e-6, f"played differs from the pipeline output: max {err.max()} at {err.argmax()} of {len(want)}"
    assert abs(done["audio_s"] - len(expected_pcm(service_pipeline, text, seed, voice)) / 24000) < 1e-3
    return done


def test_good_request_plays_exactly_the_pipeline_output(dev_daemon, service_pipeline):
    mode = stat.S_IMODE(os.stat(dev_daemon.socket).st_mode)
    assert stat.S_ISSOCK(os.stat(dev_daemon.socket).st_mode) and mode == 0o660, oct(mode)
    assert _device_rate(dev_daemon) == 44100     # the device default: 24 kHz PCM was resampled
    _assert_plays(dev_daemon, service_pipeline, "Hello world, this is the appliance.", seed=11)


BAD = [
    ({"type": "speak", "text": ""}, "bad_text"),
    ({"type": "speak", "text": "？！。，……"}, "bad_text"),
    ({"type": "speak", "text": "hello", "colour": "red"}, "bad_request"),
    (b'{"type": "speak", "text": "hello"', "bad_request"),                  # bad JSON
    (b'{"type": "speak", "text": "caf\xe9"}', "bad_request"),               # latin-1, not UTF-8
    ({"type": "speak", "text": "a" * 301}, "bad_text"),                      # > service.max_text_chars
    ({"type": "speak", "text": "hi " * 2000}, "bad_request"),                # line > service.max_line_bytes
    ({"type": "speak", "text": "hello", "voice": "this is not a speaker string"}, "bad_speaker"),
    ({"type": "speak", "text": "hello", "channel": "kitchen"}, "unknown_channel"),
    ({"type": "shout", "text": "hello"}, "bad_request"),
    ([1, 2, 3], "bad_request"),
    # negative seeds used to start, fail in the sampler and leak a decode slot each
    ({"type": "speak", "text": "hello", "seed": -5}, "bad_request"),
    ({"type": "speak", "text": "hello", "seed": -5}, "bad_request"),
    ({"type": "speak", "text": "hello", "seed": -5}, "bad_request"),
    ({"type": "speak", "text": "hello", "voice": "seed:" + "9" * 3000}, "bad_speaker"),
]


def test_each_bad_request_gets_its_error_and_the_daemon_keeps_playing(dev_daemon, service_pipeline):
    s = dev_daemon.connect()
    try:   # all on one connection: an error never closes it
        for req, code in BAD:
            s.send(req)
            (ev,) = s.events(("error", "done"))
            assert ev["type"] == "error" and ev["code"] == code, (req, ev)
            assert ev["message"]
    finally:
        s.close()
    assert dev_daemon.proc.poll() is None
    _assert_plays(dev_daemon, service_pipeline, "Still speaking after bad requests.", seed=12)


def test_garbage_and_abrupt_disconnect_do_not_hurt(dev_daemon, service_pipeline):
    s = dev_daemon.connect()
    s.sendall(b"\x00\x01\x02 garbage without newline")
    s.close()
    s = dev_daemon.connect()
    s.sendall(b"x" * 10000)        # an over-long line, then gone
    s.close()
    assert _status(dev_daemon)["state"] == "ready"


def test_client_disconnecting_mid_request_does_not_lose_it(dev_daemon, service_pipeline):
    text, seed = "Nobody is listening anymore.", 13
    s = dev_daemon.connect()
    s.send({"type": "speak", "text": text, "seed": seed, "id": "gone-1"})
    (ev,) = s.events(("accepted", "error"))
    assert ev["type"] == "accepted"
    s.close()
    want = resample_like_daemon(expected_pcm(service_pipeline, text, seed), _device_rate(dev_daemon))
    played, want = wait_played(dev_daemon.alsa, want)
    assert np.abs(played - want).max() <= 1e-6


def test_cancel_queued_and_playing(dev_daemon):
    long = {"max_new_tokens": 200}   # ~4 s of audio: still running or playing when the cancel arrives
    a = dev_daemon.connect()
    a.send({"type": "speak", "text": "The first one plays for a while.", "seed": 1, "id": "c-a", "params": long})
    a.send({"type": "speak", "text": "The second one waits.", "seed": 2, "id": "c-b", "params": long})
    evs, _ = a.events_until_ids({"c-a", "c-b"}, ("accepted",))
    b = dev_daemon.connect()
    try:   # cancelled from another connection: the canceller is told too
        b.send({"type": "cancel", "id": "c-b"})
        got = b.events(("cancel_done",))          # the reply to a cancel ends with cancel_done
        assert got[-2] == {"type": "error", "code": "cancelled", "id": "c-b", "message": "request c-b was cancelled"}
        assert got[-1]["cancelled"] == 1 and got[-1]["ids"] == ["c-b"]
        b.send({"type": "cancel", "id": "c-a"})
        assert b.events(("cancel_done",))[-2]["code"] == "cancelled"
        b.send({"type": "cancel", "id": "no-such-request"})
        (ev,) = b.events(("error",))
        assert ev["code"] == "bad_request" and "no-such-request" in ev["message"]
    finally:
        b.close()
    more, ends = a.events_until_ids({"c-a", "c-b"})
    a.close()
    evs += more
    assert ends["c-a"]["code"] == "cancelled" and ends["c-b"]["code"] == "cancelled", evs
    assert not any(e["type"] == "done" for e in evs)
    deadline = time.monotonic() + 5
    while _status(dev_daemon)["channels"]["main"]["buffered_ms"] > 0:   # c-a's unplayed audio is dropped
        assert time.monotonic() < deadline, _status(dev_daemon)
        time.sleep(0.05)


def test_cancel_with_id_and_channel_is_ambiguous_and_a_request_without_type_is_a_speak(dev_daemon):
    s = dev_daemon.connect()
    try:
        s.send({"type": "cancel", "id": "amb-1", "channel": "main"})
        (ev,) = s.events(("error", "cancel_done"))
        assert ev["type"] == "error" and ev["code"] == "bad_request", ev
        assert "both 'id' ('amb-1') and 'channel' ('main') is ambiguous" in ev["message"], ev
        s.send({"text": "hello", "id": "untyped-1", "seed": 4, "params": {"max_new_tokens": 20}})
        evs = s.events(("done", "error"))
        assert [e["type"] for e in evs] == ["accepted", "started", "done"] and evs[-1]["id"] == "untyped-1", evs
        s.send({"id": "untyped-2"})                 # no type: a speak, so its missing text is named
        (ev,) = s.events(("error", "done"))
        assert ev["code"] == "bad_request" and "field 'text' is required in speak" in ev["message"], ev
    finally:
        s.close()


def test_status_reports_channels_and_last_timings(dev_daemon):
    st = _status(dev_daemon)
    assert st["state"] == "ready" and st["backend"] == "torch-cpu"
    main = st["channels"]["main"]
    assert main["queued"] == 0 and main["device"] == "default" and main["error"] is None
    assert isinstance(main["underruns"], int)
    assert st["last_rtf"] is None or st["last_rtf"] > 0
