"""Three channels through the real daemon: each channel bound to its own ALSA ``file`` device
(three PCMs in one generated ``.asoundrc``, each paced by ``tests/asound/pacer.py``), requests
through the real UNIX socket, the played samples compared with the pipeline's output computed
here (same seed/text/voice, resampled as the daemon does)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures_service import (
    ASOUND,
    DEFAULT_RATE,
    AlsaFile,
    resample_like_daemon,
    service_config,
)
from tests.waits import wait_for

# batched rows differ from a lone row by float32 rounding (tests/test_channels_batch.py)
ATOL = 1e-6
CHANNELS = ("front", "rear", "cabin")


def alsa_channels(home: Path, raws: dict[str, Path], rate: int = DEFAULT_RATE) -> dict[str, AlsaFile]:
    """``home/.asoundrc`` with one paced ``file`` PCM per name (``pcm.tts_<name>``)."""
    home.mkdir(parents=True, exist_ok=True)
    tmpl = (ASOUND / "asoundrc.tmpl").read_text()
    body = tmpl[tmpl.index("pcm.!default"):]
    text = ""
    for name, raw in raws.items():
        block = body.replace("pcm.!default", f"pcm.tts_{name}")
        for k, v in {"@PYTHON@": sys.executable, "@PACER@": str(ASOUND / "pacer.py"),
                     "@BYTES_PER_S@": str(rate * 4), "@RAW@": str(raw)}.items():
            block = block.replace(k, v)
        text += block + "\n"
    (home / ".asoundrc").write_text(text)
    return {name: AlsaFile(home=home, raw=raw) for name, raw in raws.items()}


def expected(pipe, text: str, seed: int, **params) -> np.ndarray:
    """What the daemon should play for this request, at the device rate."""
    from appliance.core import SynthesisRequest, SynthParams

    job = pipe.prepare(SynthesisRequest(text=text, id="want", seed=seed, params=SynthParams(**params)))
    pcm = np.concatenate([c.samples for c in pipe.run(job)])
    return resample_like_daemon(pcm, DEFAULT_RATE)


def speech(a: np.ndarray) -> np.ndarray:
    """Samples with the exact zeros (idle silence, underrun gaps) removed."""
    return a[a != 0]


def heard(f: AlsaFile) -> int:
    """Speech samples played so far on ``f`` (the device plays exact zeros when idle)."""
    return int(np.count_nonzero(f.read()))


def find_close(p: np.ndarray, e: np.ndarray, probe: int = 64, start: int = 0) -> int | None:
    """First index >= start where ``e``'s first ``probe`` samples match ``p`` within ATOL."""
    probe = min(probe, len(e))
    for k in np.flatnonzero(np.abs(p[start:] - e[0]) <= ATOL) + start:
        if len(p) - k >= probe and np.abs(p[k:k + probe] - e[:probe]).max() <= ATOL:
            return int(k)
    return None


def wait_len(f: AlsaFile, n: int, timeout_s: float = 40.0) -> np.ndarray:
    deadline = time.monotonic() + timeout_s
    while True:
        p = speech(f.read())
        if len(p) >= n or time.monotonic() > deadline:
            return p
        time.sleep(0.2)


def assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if len(got) != len(want):
        # where they part: a sample lost or zeroed there (seen once in CI: one sample short on one
        # of three devices, not reproduced since), so the next failure says where and how
        m = min(len(got), len(want))
        bad = np.flatnonzero(np.abs(got[:m] - want[:m]) > ATOL)
        i = int(bad[0]) if len(bad) else m
        raise AssertionError(f"{what}: {len(got)} samples played, {len(want)} expected; they part at sample {i} "
                             f"({i / DEFAULT_RATE:.3f} s of speech): played {got[max(0, i - 2):i + 3]}, "
                             f"expected {want[max(0, i - 2):i + 3]}")
    err = float(np.abs(got - want).max())
    assert err <= ATOL, f"{what}: max |played - expected| = {err}"


def _cfg(tiny_ckpt, tmp, **service):
    chans = [{"name": n, "device": f"tts_{n}", "queue_len": 2,
              "on_preempt": "drop" if n == "rear" else "resume"} for n in CHANNELS]
    return service_config(tiny_ckpt, tmp, audio={"output": "device"}, service={"channels": chans, **service},
                          synthesis={"max_new_tokens": 200, "voice": "seed:2"},
                          telemetry={"source": "none"}, health={"at_start": False})


@pytest.fixture
def three(tiny_ckpt, tmp_path, start_daemon):
    files = alsa_channels(tmp_path / "home", {n: tmp_path / f"{n}.raw" for n in CHANNELS})
    d = start_daemon(_cfg(tiny_ckpt, tmp_path), alsa=next(iter(files.values())))
    return d, files


def test_three_channels_concurrently_each_device_gets_exactly_its_request(three, service_pipeline):
    d, files = three
    reqs = {n: (f"Channel {n} says hello number {i}.", 40 + i) for i, n in enumerate(CHANNELS)}
    p = dict(min_new_tokens=100, max_new_tokens=120)
    c = d.connect()
    for n, (text, seed) in reqs.items():
        c.send({"type": "speak", "text": text, "seed": seed, "id": f"r-{n}", "channel": n, "params": p})
    evs, ends = c.events_until_ids({f"r-{n}" for n in CHANNELS})
    c.close()
    assert all(e["type"] == "done" and e["output"] == f"device:tts_{e['channel']}" for e in ends.values()), ends
    for n, (text, seed) in reqs.items():
        want = speech(expected(service_pipeline, text, seed, **p))
        got = wait_len(files[n], len(want))
        assert_close(got[:len(want) + 1], want, f"channel {n}")     # nothing else on this device
    log = d.log()
    for n in CHANNELS:      # all three decoded in the same batch at some step
        assert f"synthesized r-{n} on {n}:" in log
        line = next(l for l in log.splitlines() if f"synthesized r-{n} on {n}:" in l)
        assert "decode batch up to 3 rows" in line, line


def test_alert_preempts_resume_and_drop(three, service_pipeline):
    d, files = three
    long_p = dict(min_new_tokens=150, max_new_tokens=150)
    short_p = dict(min_new_tokens=40, max_new_tokens=40)
    c = d.connect()
    # front resumes the interrupted request, rear drops it (service.channels[].on_preempt)
    c.send({"type": "speak", "text": "A long normal announcement.", "seed": 50, "id": "n-front",
            "channel": "front", "params": long_p})
    c.send({"type": "speak", "text": "Another long normal one.", "seed": 51, "id": "n-rear",
            "channel": "rear", "params": long_p})
    wait_for(lambda: min(heard(files["front"]), heard(files["rear"])) >= 0.3 * DEFAULT_RATE, 30,
             "both being heard")           # ...
    for n, s in (("front", 60), ("rear", 61)):
        c.send({"type": "speak", "text": "Alert!", "seed": s, "id": f"a-{n}", "channel": n,
                "priority": "alert", "params": short_p})
    evs, ends = c.events_until_ids({"n-front", "n-rear", "a-front", "a-rear"})
    c.close()
    by_id = lambda rid: [e for e in evs if e.get("id") == rid]       # noqa: E731
    assert [e["type"] for e in by_id("n-front")] == ["accepted", "started", "preempted", "started", "done"]
    pre = [e for e in by_id("n-front") if e["type"] == "preempted"][0]
    assert pre["action"] == "resume" and pre["by"] == "a-front"
    rear = by_id("n-rear")
    assert [e["type"] for e in rear] == ["accepted", "started", "preempted", "error"], rear
    assert rear[2]["action"] == "drop" and rear[3]["code"] == "preempted"
    assert ends["a-front"]["type"] == "done" and ends["a-rear"]["type"] == "done"

    # front: [part of n-front][a-front][n-front from the start]; rear: [part of n-rear][a-rear]
    nf, af = speech(expected(service_pipeline, "A long normal announcement.", 50, **long_p)), \
        speech(expected(service_pipeline, "Alert!", 60, **short_p))
    got = wait_len(files["front"], len(af) + len(nf))
    k = find_close(got, af)
    assert k is not None and 0 < k < len(nf), "the alert did not interrupt the front request"
    assert_close(got[:k], nf[:k], "front: interrupted prefix")
    assert_close(got[k:k + len(af)], af, "front: alert")
    assert_close(got[k + len(af):], nf, "front: resumed from the start")
    nr, ar = speech(expected(service_pipeline, "Another long normal one.", 51, **long_p)), \
        speech(expected(service_pipeline, "Alert!", 61, **short_p))
    got = wait_len(files["rear"], len(ar) + 1, timeout_s=10)
    k = find_close(got, ar)
    assert k is not None and 0 < k < len(nr)
    assert_close(got[:k], nr[:k], "rear: dropped prefix")
    assert_close(got[k:], ar, "rear: alert, nothing after it")


def test_cancel_stops_playback_within_one_window_and_queue_full_is_busy(three, service_pipeline):
    d, files = three
    long_p = dict(min_new_tokens=190, max_new_tokens=190)        # ~4 s of audio
    c = d.connect()
    c.send({"type": "speak", "text": "Cancel me soon.", "seed": 70, "id": "c1", "channel": "cabin", "params": long_p})
    assert c.events(("started",))[-1]["type"] == "started"
    # queue_len 2: two wait behind the running one, the third is refused
    for rid in ("q1", "q2"):
        c.send({"type": "speak", "text": "Waiting.", "seed": 71, "id": rid, "channel": "cabin"})
        assert c.events(("accepted",))[-1]["type"] == "accepted"
    c.send({"type": "speak", "text": "One too many.", "seed": 72, "id": "q3", "channel": "cabin"})
    (err,) = [e for e in c.events(("error",)) if e["type"] == "error"]
    assert err["code"] == "busy" and "service.channels[2].queue_len (the entry with name: cabin)" in err["message"], err
    (st,) = d.request({"type": "status"})
    assert st["channels"]["cabin"]["queued"] == 2 and st["channels"]["cabin"]["active"] == "c1"
    assert st["throttle"] == "normal"
    wait_for(lambda: heard(files["cabin"]) >= DEFAULT_RATE * 0.5, 20, "half a second heard", poll_s=0.01)
    d.request({"type": "cancel", "channel": "cabin"}, until=("error",))   # the device dropped their audio
    at_cancel, size = heard(files["cabin"]), files["cabin"].size()
    evs, ends = c.events_until_ids({"c1", "q1", "q2"})
    c.close()
    assert {e["code"] for e in ends.values()} == {"cancelled"}
    # what was already in flight: the pacer's pipe (64 KiB) + PortAudio's buffer (latency_ms 50);
    # the device plays silence when idle, so once that much more reached the file, all of it has
    in_flight = 65536 + 4 * DEFAULT_RATE * 0.05
    wait_for(lambda: files["cabin"].size() >= size + in_flight + 4096, 20, "what was in flight played")
    after = 4 * (heard(files["cabin"]) - at_cancel)
    # + one streaming window (stream.chunk_tokens 24 = 512 ms) of slack; the request had ~3 s left
    window = 4 * DEFAULT_RATE * (0.05 + 24 * 512 / 24000)
    assert after <= 65536 + window, f"{after} bytes of speech played after the cancel"
    want = speech(expected(service_pipeline, "Cancel me soon.", 70, **long_p))
    got = speech(files["cabin"].read())
    assert len(got) < len(want) - 4 * DEFAULT_RATE / 4 and len(got) > 0
    assert_close(got, want[:len(got)], "cabin: the cancelled prefix")


def test_device_gone_then_back_playback_resumes(three, service_pipeline, tmp_path):
    """The rear "card" goes away while idle (its ``.asoundrc`` entry removed, its pacer dies:
    EPIPE): status and log say so, a request meanwhile completes to WAV (not lost); when the entry
    is back the device is opened again on its own (the devices are listed again every second while
    one is down) and the next request plays on it."""
    d, files = three
    alsa_channels(tmp_path / "home", {n: tmp_path / f"{n}.raw" for n in CHANNELS if n != "rear"})
    for pid in files["rear"].pacers():
        os.kill(pid, signal.SIGKILL)
    st = wait_for(lambda: (lambda s: s if s["channels"]["rear"]["ok"] is False else None)(
        d.request({"type": "status"})[0]), 10, "status showing the rear device failed")
    assert st["channels"]["rear"]["error"]
    assert st["channels"]["front"]["ok"] is True                  # the other devices are unaffected
    evs = d.request({"type": "speak", "text": "Meanwhile.", "seed": 80, "id": "gone", "channel": "rear"})
    assert evs[-1]["type"] == "done" and evs[-1]["output"].endswith("gone.wav"), evs
    alsa_channels(tmp_path / "home", {n: tmp_path / f"{n}.raw" for n in CHANNELS})     # plugged back
    st = wait_for(lambda: (lambda s: s if s["channels"]["rear"]["ok"] is True else None)(
        d.request({"type": "status"})[0]), 20, "the rear device back")
    assert st["channels"]["rear"]["output"] == "device", st
    before = heard(files["rear"])
    p = dict(min_new_tokens=40, max_new_tokens=40)
    evs = d.request({"type": "speak", "text": "I am back.", "seed": 81, "id": "back", "channel": "rear", "params": p})
    assert evs[-1]["type"] == "done" and evs[-1]["output"] == "device:tts_rear", evs
    want = speech(expected(service_pipeline, "I am back.", 81, **p))
    got = wait_len(files["rear"], before + len(want), timeout_s=10)[before:]
    assert_close(got, want, "rear after the device came back")
    assert "sound device 'tts_rear' failed" in d.log() and "is back" in d.log()


def test_device_gone_request_waits_and_plays_when_it_returns(tiny_ckpt, tmp_path, start_daemon, service_pipeline):
    """``audio.on_device_error: wait``: a request for a device that is down is held (status says
    so), not written to WAV; when the device is back it plays there, whole, and only then ``done``."""
    files = alsa_channels(tmp_path / "home", {"front": tmp_path / "front.raw"})
    cfg = _cfg(tiny_ckpt, tmp_path)
    cfg["service"]["channels"] = cfg["service"]["channels"][:1]
    cfg["audio"]["on_device_error"] = "wait"
    d = start_daemon(cfg, alsa=files["front"])
    files["front"].unplug()
    st = wait_for(lambda: (lambda s: s if s["channels"]["front"]["ok"] is False else None)(
        d.request({"type": "status"})[0]), 10, "status showing the front device failed")
    assert st["channels"]["front"]["output"] == "waiting for the device", st
    before = heard(files["front"])
    p = dict(min_new_tokens=40, max_new_tokens=40)
    c = d.connect()
    c.send({"type": "speak", "text": "Hold me.", "seed": 90, "id": "held", "channel": "front", "params": p})
    assert c.events(("started",))[-1]["type"] == "started"
    wait_for(lambda: d.request({"type": "status"})[0]["channels"]["front"]["waiting_for_device"] == 1, 10,
             "the request held")
    files["front"].replug()                             # plugged back: it plays from its start
    (done,) = [e for e in c.events(("done", "error")) if e["type"] in ("done", "error")]
    c.close()
    assert done["type"] == "done" and done["output"] == "device:tts_front", done
    assert not (d.wav_dir / "held.wav").exists()
    want = speech(expected(service_pipeline, "Hold me.", 90, **p))
    got = wait_len(files["front"], before + len(want), timeout_s=10)[before:]
    assert_close(got, want, "front after the device came back")
    assert "waits for the device" in d.log() and "playing it from the start" in d.log()
