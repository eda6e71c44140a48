"""Time to first audio where the user hears it: ``done.ttfb_ms`` runs from the request's arrival to
its first sample written to the sound device (a real ALSA file device here), and
``done.synthesis_ttfb_ms`` is the pipeline's own part."""

from __future__ import annotations

import numpy as np

from appliance.audio.mix import Lanes
from tests.fixtures_service import alsa_home, service_config


def test_first_samples_written_call_on_first_once_with_the_write_time():
    lanes = Lanes()
    got = []
    lanes.begin("a", "main", lambda reason: None, on_first=got.append)
    out = np.zeros(64, np.float32)
    played: list = []
    assert lanes.mix(out, 64, played_at=5.0, played=played, written_at=4.9)[0] == 0   # nothing queued yet
    assert not played
    lanes.push("a", np.ones(100, np.float32), None)
    lanes.mix(out, 64, played_at=6.0, played=played, written_at=5.9)
    lanes.mix(out, 64, played_at=7.0, played=played, written_at=6.9)
    for _, cb in played:
        cb()
    assert got == [5.9]                                  # once, with the time of the first write


def test_done_ttfb_spans_arrival_to_the_device_and_includes_synthesis(tiny_ckpt, tmp_path, start_daemon):
    alsa = alsa_home(tmp_path / "home", tmp_path / "played.raw")
    d = start_daemon(service_config(tiny_ckpt, tmp_path, audio={"output": "device"}), alsa=alsa)
    s = d.connect()
    s.send({"type": "speak", "text": "你好，今天天气很好。", "seed": 5, "id": "t1", "params": {"max_new_tokens": 60}})
    _, ends = s.events_until_ids({"t1"})
    s.close()
    done = ends["t1"]
    assert done["type"] == "done" and done["output"].startswith("device:")
    assert 0 < done["synthesis_ttfb_ms"] < done["ttfb_ms"]     # arrival..device includes prepare and the device write
