"""Sound devices that come and go, with real parts: the real daemon, PortAudio through ALSA plugin
devices written into an ``.asoundrc`` that the test rewrites between requests (a "card" is a
``file`` PCM paced by ``tests/asound/pacer.py``; a speaker unplugged loses its PCM and its pacer;
plugged back it has another name and PortAudio index, as a USB speaker comes back under another
card index), and a second process holding a device (``tests/asound/holder.py``: ALSA's ``shm``
plugin asks it to open the device and it answers ``EBUSY``). Each request's outcome is checked:
played on the device it names (samples compared), or an error that names what was looked for and
what was found, never ``done`` for audio that did not play; health names the condition and clears."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures_service import ASOUND, DEFAULT_RATE, AlsaFile, service_config
from tests.test_channels_service import assert_close, expected, speech, wait_len
from tests.waits import wait_for

P = dict(min_new_tokens=30, max_new_tokens=30)


def write_rc(home: Path, pcms: dict) -> None:
    """``home/.asoundrc``: name -> a raw file (a paced ``file`` PCM) or ``("held", socket)`` (a
    device the holder at that socket keeps busy)."""
    home.mkdir(parents=True, exist_ok=True)
    tmpl = (ASOUND / "asoundrc.tmpl").read_text()
    body = tmpl[tmpl.index("pcm.!default"):]
    text = ""
    for name, what in pcms.items():
        if isinstance(what, tuple):
            text += f'server.holder_{name} {{ host "localhost" socket "{what[1]}" }}\n'
            text += f'pcm.{name} {{ type shm server "holder_{name}" pcm "held" }}\n'
            continue
        block = body.replace("pcm.!default", f"pcm.{name}")
        for k, v in {"@PYTHON@": sys.executable, "@PACER@": str(ASOUND / "pacer.py"),
                     "@BYTES_PER_S@": str(DEFAULT_RATE * 4), "@RAW@": str(what)}.items():
            block = block.replace(k, v)
        text += block + "\n"
    tmp = home / ".asoundrc.tmp"
    tmp.write_text(text)
    os.replace(tmp, home / ".asoundrc")


def kill_pacers(raw: Path) -> None:
    for pid in AlsaFile(home=raw.parent, raw=raw).pacers():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def status(d) -> dict:
    return d.request({"type": "status"})[0]


def _cfg(tiny_ckpt, tmp, **audio):
    return service_config(tiny_ckpt, tmp, audio={"output": "device", "device": "usbspk", **audio},
                          telemetry={"source": "none"})


def test_a_speaker_unplugged_and_plugged_back_under_another_card_plays_again_without_a_restart(
        tiny_ckpt, tmp_path, start_daemon, service_pipeline):
    home = tmp_path / "home"
    card1, card2, other = tmp_path / "card1.raw", tmp_path / "card2.raw", tmp_path / "other.raw"
    write_rc(home, {"tts_other": other, "usbspk_card1": card1})
    d = start_daemon(_cfg(tiny_ckpt, tmp_path, on_device_error="fail"), alsa=AlsaFile(home, card1))
    evs = d.request({"type": "speak", "text": "Before.", "seed": 1, "id": "before", "params": P})
    assert evs[-1]["type"] == "done" and evs[-1]["output"] == "device:usbspk_card1", evs

    write_rc(home, {"tts_other": other})                  # unplugged: gone from ALSA, its stream dies
    kill_pacers(card1)
    # first "failed: the output stream stopped", then, once the devices were listed again, what is there
    st = wait_for(lambda: (lambda s: s if s["conditions"] and "PortAudio lists" in s["conditions"][0]["reason"]
                           else None)(status(d)), 20, "status showing the speaker lost", show=lambda: d.log()[-2000:])
    assert st["channels"]["main"]["fault"] == "device_lost", st
    (cond,) = st["conditions"]
    assert st["health"] == "unhealthy" and cond["name"] == "device_missing", st
    assert "looked for 'usbspk'" in cond["reason"] and "'tts_other'" in cond["reason"], cond
    evs = d.request({"type": "speak", "text": "Meanwhile.", "seed": 2, "id": "meanwhile", "params": P})
    assert evs[-1]["type"] == "error" and evs[-1]["code"] == "device_lost", evs      # fails fast, not 'done'
    assert "looked for 'usbspk'" in evs[-1]["message"] and "PortAudio lists: 'tts_other'" in evs[-1]["message"]
    assert not (d.wav_dir / "meanwhile.wav").exists()

    t_plug = time.monotonic()                             # plugged back: another name, another index
    write_rc(home, {"aaa_first": tmp_path / "first.raw", "tts_other": other, "usbspk_card2": card2})
    st = wait_for(lambda: (lambda s: s if s["channels"]["main"]["ok"] else None)(status(d)), 20,
                  "the speaker back", show=lambda: d.log()[-2000:])
    print(f"replug -> device open again: {time.monotonic() - t_plug:.2f} s")
    assert st["channels"]["main"]["device"] == "usbspk_card2" and st["health"] == "healthy", st
    evs = d.request({"type": "speak", "text": "After.", "seed": 3, "id": "after", "params": P})
    assert evs[-1]["type"] == "done" and evs[-1]["output"] == "device:usbspk_card2", evs
    want = speech(expected(service_pipeline, "After.", 3, **P))
    assert_close(wait_len(AlsaFile(home, card2), len(want), timeout_s=15), want, "the speaker plugged back")
    assert "is back" in d.log()


@pytest.fixture
def holder(tmp_path):
    """A second process holding the device (tests/asound/holder.py), and its socket."""
    sock = tmp_path / "holder.sock"
    p = subprocess.Popen([sys.executable, str(ASOUND / "holder.py"), str(sock)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "holding"
    yield p, sock
    p.terminate()
    p.wait(10)


def test_a_device_another_process_holds_is_busy_then_plays_when_it_lets_go(
        tiny_ckpt, tmp_path, start_daemon, holder, service_pipeline):
    proc, sock = holder
    home, raw = tmp_path / "home", tmp_path / "usbspk.raw"
    write_rc(home, {"usbspk": ("held", sock)})
    aplay = subprocess.run(["aplay", "-q", "-D", "usbspk", "-d", "1", "/dev/zero"], env=dict(os.environ, HOME=str(home)),
                           capture_output=True, text=True)
    assert "busy" in aplay.stderr, aplay.stderr        # the holder is what ALSA itself reports as busy
    d = start_daemon(_cfg(tiny_ckpt, tmp_path, on_device_error="fail"), alsa=AlsaFile(home, raw))
    st = status(d)
    assert st["channels"]["main"]["fault"] == "device_busy" and st["health"] == "degraded", st
    assert "another process holds it" in st["conditions"][0]["reason"], st
    evs = d.request({"type": "speak", "text": "Busy.", "seed": 4, "id": "busy", "params": P})
    assert evs[-1]["type"] == "error" and evs[-1]["code"] == "device_busy", evs
    assert "looked for 'usbspk'" in evs[-1]["message"] and "Device or resource busy" in evs[-1]["message"]

    proc.terminate()                                      # it lets go
    proc.wait(10)
    write_rc(home, {"usbspk": raw})
    st = wait_for(lambda: (lambda s: s if s["channels"]["main"]["ok"] else None)(status(d)), 20,
                  "the device free", show=lambda: d.log()[-2000:])
    assert st["health"] == "healthy" and st["conditions"] == [], st
    evs = d.request({"type": "speak", "text": "Free.", "seed": 5, "id": "free", "params": P})
    assert evs[-1]["type"] == "done" and evs[-1]["output"] == "device:usbspk", evs
    want = speech(expected(service_pipeline, "Free.", 5, **P))
    assert_close(wait_len(AlsaFile(home, raw), len(want), timeout_s=15), want, "the device freed")


def test_requests_wait_for_a_missing_device_in_a_bounded_queue(tiny_ckpt, tmp_path, start_daemon):
    """``audio.on_device_error: wait`` with ``audio.max_waiting: 1`` and ``audio.max_wait_s: 2``:
    one request waits (status says so), the next one fails at once, the waiting one ends
    ``device_lost`` after its 2 s; nothing is played or written for either."""
    home = tmp_path / "home"
    write_rc(home, {"tts_other": tmp_path / "other.raw"})          # the speaker is not there at start
    d = start_daemon(_cfg(tiny_ckpt, tmp_path, on_device_error="wait", max_waiting=1, max_wait_s=2.0),
                     alsa=AlsaFile(home, tmp_path / "other.raw"))
    c = d.connect()
    c.send({"type": "speak", "text": "Wait.", "seed": 6, "id": "w1", "params": P})
    assert c.events(("started",))[-1]["type"] == "started"
    wait_for(lambda: status(d)["channels"]["main"]["waiting_for_device"] == 1, 20, "w1 waiting")
    evs = d.request({"type": "speak", "text": "Too many.", "seed": 7, "id": "w2", "params": P})
    assert evs[-1]["code"] == "device_lost" and "1 request(s) already wait" in evs[-1]["message"], evs
    end = c.events(("done", "error"))[-1]
    assert end["type"] == "error" and end["code"] == "device_lost" and "audio.max_wait_s" in end["message"], end
    c.close()
    assert not list(d.wav_dir.glob("*.wav")) if d.wav_dir.exists() else True
