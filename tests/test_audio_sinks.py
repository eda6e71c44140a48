"""Sinks as they are in the field, through the real daemon and real ALSA plugin devices
(tests/asound: ``file`` PCMs paced by pacer.py): a device whose sample formats PortAudio cannot
write (through ALSA's plug converter), the default route re-pointed (``.asoundrc`` rewritten +
SIGHUP), and a stream closed while idle that wakes with its pre-roll."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import numpy as np

from tests.fixtures_service import (
    ASOUND,
    DEFAULT_RATE,
    AlsaFile,
    expected_pcm,
    resample_like_daemon,
    service_config,
    wait_played,
)
from tests.waits import wait_for, wait_log


def _file_pcm(name: str, raw: Path, bytes_per_s: int) -> str:
    """An ``.asoundrc`` entry: PCM ``name`` writes raw frames to ``raw``, paced at ``bytes_per_s``."""
    return (f'pcm.{name} {{ type file slave.pcm "null" format "raw" '
            f'file "|exec {sys.executable} {ASOUND / "pacer.py"} {bytes_per_s} {raw}" }}\n')


def _span(a: np.ndarray) -> tuple[int, int]:
    """First and one-past-last index where ``a`` is above mu-law's quietest steps (0, 0 if never)."""
    loud = np.flatnonzero(np.abs(a) >= 2e-3)
    return (int(loud[0]), int(loud[-1]) + 1) if len(loud) else (0, 0)


def test_device_whose_formats_portaudio_cannot_write_plays_through_a_plug_converter(
        tiny_ckpt, tmp_path, start_daemon, service_pipeline):
    # ALSA's mulaw plugin over a 16-bit file PCM accepts MU_LAW only: PortAudio writes none of its
    # formats ("Sample format not supported"), as with a 4-byte S24_LE-only codec. (alsa-lib 1.2.8
    # has no plugin that leaves a card-less device with S24_LE alone: `share` would, but it crashes
    # PortAudio's listing; the path is the same for any format: ALSA is asked what the device offers.)
    home, raw = tmp_path / "home", tmp_path / "mu.raw"
    home.mkdir()
    (home / ".asoundrc").write_text(_file_pcm("tts_s16", raw, 2 * DEFAULT_RATE)
                                    + 'pcm.tts_mu { type mulaw slave { pcm "tts_s16" format S16_LE } }\n')
    alsa = AlsaFile(home=home, raw=raw)
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "device", "device": "tts_mu", "sample_rate": DEFAULT_RATE})
    d = start_daemon(cfg, alsa=alsa)
    log = wait_log(d.log, "it plays through ALSA's plug converter", alive=d.alive)
    assert "'tts_mu' offers only MU_LAW, which PortAudio cannot write" in log
    assert "'tts_mu' -> mulaw -> file (" in log and "(through ALSA's plug converter 'chattts_plug_0'" in log
    text, seed = "Played through the converter.", 41
    evs = d.request({"type": "speak", "text": text, "seed": seed, "id": "mu"})
    assert evs[-1]["type"] == "done" and evs[-1]["output"] == "device:tts_mu", evs
    want = resample_like_daemon(expected_pcm(service_pipeline, text, seed), DEFAULT_RATE)
    w0, w1 = _span(want)

    def whole() -> list:
        a = np.fromfile(raw, "<i2").astype(np.float32) / 32768
        g0, g1 = _span(a)
        return [a] if g1 - g0 >= w1 - w0 - 8 else []

    (got,) = wait_for(whole, 30, "the whole request in the 16-bit file")
    g0, g1 = _span(got)
    # the right length: the speech spans the same samples (mu-law keeps 8 bits of each)
    assert abs((g1 - g0) - (w1 - w0)) <= 8, (g1 - g0, w1 - w0)
    g, w = got[g0:g0 + (w1 - w0)], want[w0:w1]
    rms_got, rms_want = np.sqrt(np.mean(g ** 2)), np.sqrt(np.mean(w ** 2))
    assert abs(rms_got / rms_want - 1) < 0.03, (rms_got, rms_want)       # the right level
    assert np.corrcoef(g, w)[0, 1] > 0.99
    (st,) = d.request({"type": "status"})
    assert "chattts_plug_0" in st["channels"]["main"]["route"]


def test_default_route_repointed_and_sighup_next_request_plays_on_the_new_device(
        tiny_ckpt, tmp_path, start_daemon, service_pipeline):
    home = tmp_path / "home"
    home.mkdir()
    old, new = tmp_path / "old.raw", tmp_path / "new.raw"

    def point_default_at(raw: Path) -> None:
        text = _file_pcm("!default", raw, 4 * DEFAULT_RATE)
        tmp = home / ".asoundrc.tmp"
        tmp.write_text(text)
        tmp.replace(home / ".asoundrc")

    point_default_at(old)
    d = start_daemon(service_config(tiny_ckpt, tmp_path, audio={"output": "device"}), alsa=AlsaFile(home, old))
    wait_log(d.log, f"it plays on 'default' -> file (|exec {sys.executable}", alive=d.alive)
    assert str(old) in d.log()                  # the log names the real device behind `default`
    first = ("Before the move.", 51)
    assert d.request({"type": "speak", "text": first[0], "seed": first[1], "id": "r1"})[-1]["type"] == "done"
    wait_played(AlsaFile(home, old), resample_like_daemon(expected_pcm(service_pipeline, *first), DEFAULT_RATE))
    point_default_at(new)                       # another sink becomes the default
    d.proc.send_signal(signal.SIGHUP)
    wait_log(d.log, "finding their routes again (SIGHUP)", alive=d.alive)
    assert f"its route changed; it now plays on 'default' -> file (" in wait_log(d.log, str(new), alive=d.alive)
    heard_old = np.count_nonzero(AlsaFile(home, old).read())
    second = ("After the move.", 52)
    evs = d.request({"type": "speak", "text": second[0], "seed": second[1], "id": "r2"})
    assert evs[-1]["type"] == "done", evs
    got, want = wait_played(AlsaFile(home, new), resample_like_daemon(expected_pcm(service_pipeline, *second), DEFAULT_RATE))
    assert np.abs(got - want).max() <= 1e-6      # float32 rounding of another run (tests/test_channels_batch.py)
    assert np.count_nonzero(AlsaFile(home, old).read()) == heard_old      # nothing more on the old one


def test_idle_stream_is_closed_and_a_request_wakes_it_with_its_preroll(
        tiny_ckpt, tmp_path, start_daemon, service_pipeline, alsa_file):
    cfg = service_config(tiny_ckpt, tmp_path, audio={"output": "device", "idle_close_s": 1.0, "preroll_ms": 300.0})
    d = start_daemon(cfg, alsa=alsa_file)
    wait_log(d.log, "idle for 1 s: its stream is closed", alive=d.alive)
    size = alsa_file.wait_flushed()             # its pacer exits: the stream is closed
    assert alsa_file.pacers() == []
    (st,) = d.request({"type": "status"})
    assert st["channels"]["main"]["asleep"] is True and st["channels"]["main"]["ok"] is True
    text, seed = "Wake up and speak.", 61
    evs = d.request({"type": "speak", "text": text, "seed": seed, "id": "wake"})
    assert evs[-1]["type"] == "done" and evs[-1]["output"].startswith("device:"), evs
    want = resample_like_daemon(expected_pcm(service_pipeline, text, seed), DEFAULT_RATE)
    got, exp = wait_played(alsa_file, want)
    assert np.abs(got - exp).max() <= 1e-6
    after = alsa_file.read(size)                # what the woken stream played
    first = int(np.flatnonzero(after)[0])
    assert first >= 0.3 * DEFAULT_RATE, f"speech began {first} frames after the stream opened (pre-roll 300 ms)"
